"""Each stop mapping of the Anthropic Messages and Responses dialects, on the wire, through the proxy.

The upstream replays the byte shapes these servers send (tests.support.wire, from the SDKs' types
and the servers' sources); the record must say what the wire did.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from proxy.serve.app import RunningProxy
from tests.support.proxies import record_for
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.wire import (
    ANTHROPIC_HEADERS,
    JSON_HEADERS,
    anthropic_error,
    anthropic_message,
    anthropic_stream,
    named_sse,
    responses_body,
    responses_stream,
)

MESSAGES: dict[str, Any] = {"model": "m", "max_tokens": 16, "stream": True,
                            "messages": [{"role": "user", "content": "hi"}]}
RESPONSES: dict[str, Any] = {"model": "m", "input": "hi", "max_output_tokens": 16, "stream": True}


async def exchange(client: aiohttp.ClientSession, proxy: RunningProxy, upstream: ScriptedUpstream, script: Script,
                   path: str, body: dict[str, Any]) -> Any:
    upstream.push(script)
    async with client.post(proxy.proxy_url + path, json=body) as response:
        sent = await response.read()
        rid = response.headers["X-Request-Id"]
    assert sent == b"".join(script.chunks)
    return await record_for(proxy, rid)


async def messages(client: aiohttp.ClientSession, proxy: RunningProxy, upstream: ScriptedUpstream,
                   chunks: list[bytes], status: int = 200, **body: Any) -> Any:
    headers = ANTHROPIC_HEADERS if status == 200 and len(chunks) > 1 else JSON_HEADERS
    return await exchange(client, proxy, upstream, Script(chunks, status=status, headers=headers), "/v1/messages",
                          {**MESSAGES, **body})


@pytest.mark.parametrize(("tokens", "raw", "sequence", "stop", "cause"), [
    (5, "end_turn", None, "eos", None),
    (5, "stop_sequence", "###", "stop_sequence", None),
    (5, "end_turn", "###", "stop_sequence", None),  # llama.cpp's way of naming a stop word
    (16, "max_tokens", None, "length", "requested_budget"),
    (9, "max_tokens", None, "length", "server_limit"),  # the server stopped it before the budget
    (5, "tool_use", None, "tool_calls", None),
    (5, "pause_turn", None, "tool_calls", None),
    (3, "refusal", None, "content_filter", None),
    (16, "model_context_window_exceeded", None, "length", "server_limit"),  # at the budget, yet the context
])
async def test_anthropic_stop_reasons(upstream: ScriptedUpstream, proxy: RunningProxy, client: aiohttp.ClientSession,
                                      tokens: int, raw: str, sequence: str | None, stop: str,
                                      cause: str | None) -> None:
    record = await messages(client, proxy, upstream, anthropic_stream(tokens, raw, stop_sequence=sequence,
                                                                      tool=raw == "tool_use"))
    assert (record.dialect, record.finish_reason_raw, record.stop_reason, record.length_cause) == (
        "anthropic", raw, stop, cause)
    assert (record.output_tokens, record.tokens_source, record.prompt_tokens) == (tokens, "usage", 12)


async def test_anthropic_non_streaming_message(upstream: ScriptedUpstream, proxy: RunningProxy,
                                               client: aiohttp.ClientSession) -> None:
    record = await messages(client, proxy, upstream, [anthropic_message(16, "max_tokens")], stream=False)
    assert (record.stop_reason, record.length_cause, record.output_tokens, record.ttft_s) == (
        "length", "requested_budget", 16, None)


async def test_anthropic_overloaded_is_a_rejection_as_529_or_mid_stream(
        upstream: ScriptedUpstream, proxy: RunningProxy, client: aiohttp.ClientSession) -> None:
    record = await messages(client, proxy, upstream, [anthropic_error("overloaded_error", "Overloaded")], status=529)
    assert (record.status, record.stop_reason, record.upstream_error_detail) == (529, "rejected", "Overloaded")
    cut = anthropic_stream(4, "end_turn")[:-2]  # no message_delta, no message_stop: an error event instead
    cut.append(named_sse("error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}))
    record = await messages(client, proxy, upstream, cut)
    assert (record.status, record.stop_reason) == (200, "rejected")


async def test_anthropic_other_errors_are_upstream_errors(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                          client: aiohttp.ClientSession) -> None:
    record = await messages(client, proxy, upstream, [anthropic_error("invalid_request_error", "max_tokens: 0")],
                            status=400)
    assert (record.stop_reason, record.upstream_error, record.upstream_error_detail) == (
        "upstream_error", "http_status", "HTTP 400: max_tokens: 0")
    cut = anthropic_stream(4, "end_turn")[:-2]
    cut.append(named_sse("error", {"type": "error", "error": {"type": "api_error", "message": "CUDA out of memory"}}))
    record = await messages(client, proxy, upstream, cut)
    assert (record.stop_reason, record.upstream_error) == ("upstream_error", "oom")


async def test_anthropic_stream_cut_before_message_stop_is_an_upstream_disconnect(
        upstream: ScriptedUpstream, proxy: RunningProxy, client: aiohttp.ClientSession) -> None:
    record = await messages(client, proxy, upstream, anthropic_stream(6, "end_turn")[:-2])
    assert (record.stop_reason, record.output_tokens, record.tokens_source) == ("upstream_disconnect", 6, "counted")


async def test_anthropic_thinking_that_took_the_budget_is_obvious(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                                  client: aiohttp.ClientSession) -> None:
    record = await messages(client, proxy, upstream, anthropic_stream(2, "max_tokens", thinking=14))
    assert (record.stop_reason, record.length_cause, record.reasoning_tokens, record.visible_tokens) == (
        "length", "requested_budget", 14, 2)
    assert record.reasoning_share == 14 / 16 and record.budget_mostly_reasoning


async def responses_call(client: aiohttp.ClientSession, proxy: RunningProxy, upstream: ScriptedUpstream,
                         chunks: list[bytes], status: int = 200, **body: Any) -> Any:
    headers = ANTHROPIC_HEADERS if status == 200 and len(chunks) > 1 else JSON_HEADERS
    return await exchange(client, proxy, upstream, Script(chunks, status=status, headers=headers), "/v1/responses",
                          {**RESPONSES, **body})


@pytest.mark.parametrize(("tokens", "status", "reason", "terminal", "llamacpp", "stop", "cause", "certain"), [
    (5, "completed", None, None, False, "eos", None, True),
    (16, "completed", None, None, False, "eos", None, True),  # the server can say incomplete: it did not
    (16, "incomplete", "max_output_tokens", None, False, "length", "requested_budget", True),
    (16, "incomplete", "max_output_tokens", "response.completed", False, "length", "requested_budget", True),  # vLLM
    (9, "incomplete", "max_output_tokens", None, False, "length", "server_limit", True),
    (4, "incomplete", "content_filter", None, False, "content_filter", None, True),
    (16, "completed", None, None, True, "length", "requested_budget", False),  # llama.cpp: "completed" at the budget
    (5, "completed", None, None, True, "eos", None, False),  # llama.cpp: EOS, or a full context
])
async def test_responses_stop_reasons(upstream: ScriptedUpstream, proxy: RunningProxy, client: aiohttp.ClientSession,
                                      tokens: int, status: str, reason: str | None, terminal: str | None,
                                      llamacpp: bool, stop: str, cause: str | None, certain: bool) -> None:
    record = await responses_call(client, proxy, upstream, responses_stream(tokens, status, reason=reason,
                                                                            terminal=terminal, llamacpp=llamacpp))
    assert (record.dialect, record.stop_reason, record.length_cause, record.stop_reason_certain) == (
        "responses", stop, cause, certain)
    assert (record.output_tokens, record.tokens_source, record.prompt_tokens) == (tokens, "usage", 9)


async def test_responses_tool_calls_failures_and_errors(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                        client: aiohttp.ClientSession) -> None:
    record = await responses_call(client, proxy, upstream, responses_stream(3, tool=True))
    assert record.stop_reason == "tool_calls"
    record = await responses_call(client, proxy, upstream, responses_stream(3, "failed"))
    assert (record.stop_reason, record.upstream_error, record.upstream_error_detail) == (
        "upstream_error", "error_event", "the engine failed")
    cut = [*responses_stream(3)[:-1], named_sse("error", {"type": "error", "code": "server_error",
                                                          "message": "boom", "sequence_number": 9})]
    record = await responses_call(client, proxy, upstream, cut)
    assert (record.stop_reason, record.upstream_error) == ("upstream_error", "error_event")


async def test_responses_non_streaming_and_reasoning(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                     client: aiohttp.ClientSession) -> None:
    record = await responses_call(client, proxy, upstream,
                                  [responses_body(1, "incomplete", reason="max_output_tokens", reasoning=15)],
                                  stream=False)
    assert (record.stop_reason, record.length_cause, record.reasoning_tokens, record.visible_tokens) == (
        "length", "requested_budget", 15, 1)
    assert record.ttft_s is None and record.budget_mostly_reasoning
    record = await responses_call(client, proxy, upstream, responses_stream(3, reasoning=8, usage=False))
    assert (record.stop_reason, record.output_tokens, record.tokens_source, record.reasoning_tokens) == (
        "eos", 11, "counted", 8)


async def test_count_tokens_is_not_a_generation(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                client: aiohttp.ClientSession) -> None:
    record = await exchange(client, proxy, upstream, Script([b'{"input_tokens": 12}'], headers=JSON_HEADERS),
                            "/v1/messages/count_tokens", {"model": "m", "messages": []})
    assert (record.route, record.stop_reason, record.concurrency_at_start) == ("other", "not_inference", 0)
