"""Answers that look complete but cannot be used, through the proxy with the official `openai` and
`anthropic` clients: a tool call cut by the budget that vLLM calls `tool_calls` (vllm#53269), a
broken one below the budget, JSON left open under `stop` (vllm#12548), and Anthropic's
`input_json_delta` cut at `max_tokens`. Each is counted in `llm_proxy_incomplete_answers_total`."""

from __future__ import annotations

import re
from typing import Any

import aiohttp
import anthropic
import openai
import orjson

from proxy.serve.app import RunningProxy
from tests.support.proxies import ProxyFactory, record_for
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.wire import DONE, chat_chunk, sse, usage_chunk

TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
MESSAGES: Any = [{"role": "user", "content": "What is the weather in Canberra?"}]


def tool_stream(pieces: list[str], finish: str, completion_tokens: int) -> list[bytes]:
    """vLLM's chat stream of one tool call, its arguments in pieces (the id and name with the first)."""
    chunks = [sse(chat_chunk("", role=True))]
    for number, piece in enumerate(pieces):
        call: dict[str, Any] = {"index": 0, "function": {"arguments": piece}}
        if number == 0:
            call.update(id="call_1", type="function")
            call["function"]["name"] = "get_weather"
        chunk = chat_chunk()
        chunk["choices"][0]["delta"] = {"tool_calls": [call]}
        chunks.append(sse(chunk))
    return [*chunks, sse(chat_chunk(None, finish)), sse(usage_chunk(30, completion_tokens)), DONE]


async def incomplete(running: RunningProxy, part: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(running.admin_url + "/metrics") as response:
        text = await response.text()
    return sum(float(v) for v in re.findall(rf'^llm_proxy_incomplete_answers_total{{[^}}]*part="{part}"[^}}]*}} (\S+)$',
                                            text, re.MULTILINE))


async def test_a_tool_call_cut_by_the_budget_is_a_length_stop_and_counted(upstream: ScriptedUpstream,
                                                                          make_proxy: ProxyFactory) -> None:
    upstream.push(Script(chunks=tool_stream(['{"city": "Can', 'berra", "un'], "tool_calls", 16)))
    running = await make_proxy(upstream.url)
    client = openai.AsyncOpenAI(base_url=running.proxy_url + "/v1", api_key="k", max_retries=0,
                                default_headers={"X-Request-Id": "cut-call"})
    chunks = [c async for c in await client.chat.completions.create(
        model="m", messages=MESSAGES, tools=TOOLS, max_tokens=16, stream=True,
        stream_options={"include_usage": True})]
    assert any(c.choices and c.choices[0].finish_reason == "tool_calls" for c in chunks)  # what the client saw
    record = await record_for(running, "cut-call")
    assert (record.stop_reason, record.length_cause, record.finish_reason_raw, record.answer_complete) == (
        "length", "requested_budget", "tool_calls", False)
    assert await incomplete(running, "tool_call") == 1


async def test_open_json_under_stop_is_not_whole_and_cut(upstream: ScriptedUpstream,
                                                         make_proxy: ProxyFactory) -> None:
    upstream.push(Script(chunks=[sse(chat_chunk("", role=True)), sse(chat_chunk('{"temperature": ')),
                                 sse(chat_chunk(None, "stop")), DONE]))
    running = await make_proxy(upstream.url)
    client = openai.AsyncOpenAI(base_url=running.proxy_url + "/v1", api_key="k", max_retries=0,
                                default_headers={"X-Request-Id": "open-json"})
    stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True,
                                                  response_format={"type": "json_object"})
    [c async for c in stream]
    record = await record_for(running, "open-json")
    assert (record.stop_reason, record.answer_complete, record.cause, record.outcome) == (
        "eos", False, "answer_incomplete", "cut")
    assert await incomplete(running, "json") == 1


async def test_anthropics_tool_input_cut_at_max_tokens(upstream: ScriptedUpstream, make_proxy: ProxyFactory) -> None:
    events = [
        ("message_start", {"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 30, "output_tokens": 1}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {
            "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
            "type": "input_json_delta", "partial_json": '{"city": "Canb'}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                           "usage": {"output_tokens": 12}}),
        ("message_stop", {"type": "message_stop"})]
    upstream.push(Script(chunks=[f"event: {name}\ndata: ".encode() + orjson.dumps(data) + b"\n\n"
                                 for name, data in events]))
    running = await make_proxy(upstream.url)
    client = anthropic.AsyncAnthropic(base_url=running.proxy_url, api_key="k", max_retries=0,
                                      default_headers={"X-Request-Id": "anthropic-cut"})
    async with client.messages.stream(model="m", max_tokens=12, messages=MESSAGES,
                                      tools=[{"name": "get_weather", "input_schema": {"type": "object"}}]) as stream:
        async for _ in stream:
            pass
    record = await record_for(running, "anthropic-cut")
    assert (record.stop_reason, record.answer_complete, record.incomplete_part) == ("length", False, "tool_call")


def tool_stream_without_finish(pieces: list[str], completion_tokens: int) -> list[bytes]:
    """vLLM's stream with tools that ends `finish_reason: null`, then usage and [DONE] (vllm#27572:
    granite-3-8b with `tool_choice: auto`, the last chunk's finish_reason intermittently null)."""
    chunks = tool_stream(pieces, "tool_calls", completion_tokens)
    return [chunk for chunk in chunks if b'"finish_reason":"tool_calls"' not in chunk]


async def test_a_tool_stream_without_a_finish_reason_says_the_server_gave_none(upstream: ScriptedUpstream,
                                                                               make_proxy: ProxyFactory) -> None:
    """Whole arguments below the budget: usable, and the stop is not named eos on a guess. Cut arguments
    at the budget: the budget cut it, whatever the missing finish reason."""
    upstream.push(Script(chunks=tool_stream_without_finish(['{"city": ', '"Canberra"}'], 9)))
    upstream.push(Script(chunks=tool_stream_without_finish(['{"city": "Can', 'berra", "un'], 16)))
    running = await make_proxy(upstream.url)
    for rid in ("null-whole", "null-cut"):
        client = openai.AsyncOpenAI(base_url=running.proxy_url + "/v1", api_key="k", max_retries=0,
                                    default_headers={"X-Request-Id": rid})
        chunks = [c async for c in await client.chat.completions.create(
            model="m", messages=MESSAGES, tools=TOOLS, max_tokens=16, stream=True,
            stream_options={"include_usage": True})]
        assert all(c.choices[0].finish_reason is None for c in chunks if c.choices)
    whole, cut = await record_for(running, "null-whole"), await record_for(running, "null-cut")
    assert whole.finish_reason_raw is None and whole.stop_reason != "eos"
    assert (whole.answer_complete, whole.output_tokens) == (True, 9)
    assert (cut.stop_reason, cut.length_cause, cut.answer_complete, cut.incomplete_part) == (
        "length", "requested_budget", False, "tool_call")


async def test_output_counted_on_a_stream_that_delivered_none_is_a_mismatch(upstream: ScriptedUpstream,
                                                                           make_proxy: ProxyFactory) -> None:
    """Usage above what the stream delivered: speculative decoding charging the whole budget while the
    emission stopped early (ik_llama.cpp PR #2358), at its extreme, an LM Studio-like stream that
    carried no output while its usage counts the budget (lmstudio-bug-tracker#2339). A stream that
    delivered some pieces is not compared: a piece may carry several tokens."""
    upstream.push(Script(chunks=[sse(chat_chunk("", role=True)), sse(chat_chunk(None, "length")),
                                 sse(usage_chunk(30, 64)), DONE]))
    running = await make_proxy(upstream.url)
    client = openai.AsyncOpenAI(base_url=running.proxy_url + "/v1", api_key="k", max_retries=0,
                                default_headers={"X-Request-Id": "spec"})
    [c async for c in await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=64,
                                                               stream=True, stream_options={"include_usage": True})]
    record = await record_for(running, "spec")
    assert record.usage_mismatch == "completion_tokens 64, while the stream delivered no output at all"
