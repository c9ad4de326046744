"""The captured llama-server bodies, replayed through the proxy by a stand-in upstream: no server needed.

Each fixture is served with the status and content type it was captured with (SSE one event per
write), for the request that produced it, so the record must say what the real server did.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.real_servers.llamacpp.llama_server import REPO_ROOT

pytestmark = pytest.mark.llamacpp

FIXTURES = REPO_ROOT / "tests" / "fixtures" / "llamacpp"
INDEX: dict[str, Any] = json.loads((FIXTURES / "index.json").read_text())["files"]
FIXTURE_HEADER = "X-Replay-Fixture"

# What the real server did, per fixture: (stop_reason, length_cause, truncated_flag, upstream_error).
EXPECTED: dict[str, tuple[str, str | None, bool | None, str | None]] = {
    "chat_nonstream_budget.json": ("length", "requested_budget", None, None),
    "chat_stream_budget.sse": ("length", "requested_budget", None, None),
    "chat_stream_budget_usage.sse": ("length", "requested_budget", None, None),
    "chat_nonstream_slot_limit.json": ("length", "server_limit", None, None),
    "chat_stream_slot_limit.sse": ("length", "server_limit", None, None),
    "chat_nonstream_eos.json": ("eos", None, None, None),
    "chat_stream_eos.sse": ("eos", None, None, None),
    "completions_nonstream_budget.json": ("length", "requested_budget", None, None),
    "completions_stream_budget.sse": ("length", "requested_budget", None, None),
    "completion_nonstream_budget.json": ("length", "requested_budget", False, None),
    "completion_stream_budget.sse": ("length", "requested_budget", False, None),
    "completion_nonstream_slot_limit.json": ("length", "server_limit", True, None),
    "completion_stream_slot_limit.sse": ("length", "server_limit", True, None),
    "completion_nonstream_eos.json": ("eos", None, False, None),
    "completion_stream_eos.sse": ("eos", None, False, None),
    "completion_nonstream_stop_word.json": ("stop_sequence", None, False, None),
    "completion_stream_stop_word.sse": ("stop_sequence", None, False, None),
    # The context, in the server's own words: a prompt over the slot, a shared pool run out.
    "chat_nonstream_prompt_exceeds_slot.json": ("upstream_error", None, None, "exceeds_context"),
    "chat_nonstream_unified_pool_exhausted.json": ("upstream_error", None, None, "context_exhausted"),
    "chat_stream_unified_pool_exhausted.sse": ("upstream_error", None, None, "context_exhausted"),
    # Anthropic Messages: end_turn for EOS and a stop word alike, the word named in stop_sequence.
    "messages_nonstream_budget.json": ("length", "requested_budget", None, None),
    "messages_stream_budget.sse": ("length", "requested_budget", None, None),
    "messages_nonstream_slot_limit.json": ("length", "server_limit", None, None),
    "messages_stream_slot_limit.sse": ("length", "server_limit", None, None),
    "messages_nonstream_eos.json": ("eos", None, None, None),
    "messages_stream_eos.sse": ("eos", None, None, None),
    "messages_nonstream_stop_word.json": ("stop_sequence", None, None, None),
    "messages_stream_stop_word.sse": ("stop_sequence", None, None, None),
}
# The Responses API: llama.cpp says "completed" for EOS, a spent budget and a full slot alike, and
# sends no incomplete_details: (stop_reason, length_cause), neither certain.
RESPONSES_LIMIT_BLIND: dict[str, tuple[str, str | None]] = {
    "responses_nonstream_budget.json": ("length", "requested_budget"),
    "responses_stream_budget.sse": ("length", "requested_budget"),
    "responses_nonstream_eos.json": ("eos", None),
    "responses_stream_eos.sse": ("eos", None),
    "responses_nonstream_slot_limit.json": ("eos", None),  # in truth the slot's context: the wire cannot tell
    "responses_stream_slot_limit.sse": ("eos", None),
}
# llama.cpp's OpenAI-compatible output says only finish_reason "stop" for a stop string, exactly
# as for EOS (stopping_word appears only in the native and __verbose output).
STOP_WORD_VIA_OPENAI = ("chat_nonstream_stop_word.json", "chat_stream_stop_word.sse")


def test_every_captured_fixture_has_an_expectation() -> None:
    assert set(INDEX) == set(EXPECTED) | set(STOP_WORD_VIA_OPENAI) | set(RESPONSES_LIMIT_BLIND)


async def replay(request: web.Request) -> web.StreamResponse:
    """Answer with the named fixture exactly as captured."""
    name = request.headers[FIXTURE_HEADER]
    meta = INDEX[name]
    body = (FIXTURES / name).read_bytes()
    await request.read()
    if not name.endswith(".sse"):
        return web.Response(status=meta["status"], body=body, headers={"Content-Type": meta["content_type"]})
    resp = web.StreamResponse(status=meta["status"], headers={"Content-Type": meta["content_type"]})
    await resp.prepare(request)
    for event in body.split(b"\n\n"):
        if event:
            await resp.write(event + b"\n\n")
    await resp.write_eof()
    return resp


@pytest.fixture
async def replaying_proxy(proxy_for: Any) -> AsyncIterator[Any]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", replay)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield await proxy_for(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


async def replay_through(running: Any, name: str) -> tuple[bytes, dict[str, Any]]:
    meta = INDEX[name]
    rid = f"replay-{name}"
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        async with session.post(running.proxy_url + meta["path"], json=meta["request"],
                                headers={FIXTURE_HEADER: name, "X-Request-Id": rid}) as resp:
            received = await resp.read()
            assert resp.status == meta["status"]
        deadline = time.monotonic() + 10
        while True:
            async with session.get(f"{running.admin_url}/api/requests/{rid}") as resp:
                if resp.status == 200:
                    return received, await resp.json()
            assert time.monotonic() < deadline, f"no record for {rid}"
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("name", sorted(EXPECTED))
async def test_replayed_llamacpp_response_is_recorded_as_the_server_ended_it(
    replaying_proxy: Any, name: str
) -> None:
    received, record = await replay_through(replaying_proxy, name)
    assert received == (FIXTURES / name).read_bytes()
    stop_reason, length_cause, truncated_flag, upstream_error = EXPECTED[name]
    assert record["stop_reason"] == stop_reason
    assert record["length_cause"] == length_cause
    assert record["truncated_flag"] is truncated_flag
    assert record["upstream_error"] == upstream_error
    assert record["parse_error"] is False


@pytest.mark.parametrize("name", STOP_WORD_VIA_OPENAI)
async def test_openai_stop_from_llamacpp_is_not_claimed_as_certain_eos_when_stop_strings_were_requested(
    replaying_proxy: Any, name: str
) -> None:
    # The request asked for stop strings and the server said only "stop": EOS or a stop string,
    # the wire cannot tell which. The record keeps it a complete answer but says it is not proven.
    _, record = await replay_through(replaying_proxy, name)
    assert record["finish_reason_raw"] == "stop"
    assert record["stop_reason"] == "eos" and record["stop_reason_certain"] is False


@pytest.mark.parametrize("name", sorted(RESPONSES_LIMIT_BLIND))
async def test_llamacpp_responses_completed_is_recorded_but_never_claimed_certain(
    replaying_proxy: Any, name: str
) -> None:
    received, record = await replay_through(replaying_proxy, name)
    assert received == (FIXTURES / name).read_bytes()
    assert (record["dialect"], record["finish_reason_raw"]) == ("responses", "completed")
    assert (record["stop_reason"], record["length_cause"]) == RESPONSES_LIMIT_BLIND[name]
    assert record["stop_reason_certain"] is False and record["tokens_source"] == "usage"


async def test_replayed_context_errors_keep_the_servers_message(replaying_proxy: Any) -> None:
    _, record = await replay_through(replaying_proxy, "chat_nonstream_prompt_exceeds_slot.json")
    assert "exceeds the available context size" in record["upstream_error_detail"]
    _, record = await replay_through(replaying_proxy, "chat_stream_unified_pool_exhausted.sse")
    assert "Context size has been exceeded" in record["upstream_error_detail"]
