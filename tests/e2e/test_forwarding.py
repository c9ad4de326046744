"""Transparent forwarding: status, headers and bytes reach the client unchanged, and each
response leaves exactly one record."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson

from proxy.serve.app import RunningProxy
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.wire import (
    JSON_HEADERS,
    NDJSON_HEADERS,
    SSE_HEADERS,
    ollama_stream,
    openai_completion,
    openai_stream,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 64}


async def wait_records(proxy: RunningProxy, n: int) -> None:
    for _ in range(200):
        if len(proxy.store) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"expected {n} records, have {len(proxy.store)}")


async def test_streamed_sse_bytes_pass_through_unchanged(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                         client: aiohttp.ClientSession) -> None:
    chunks = openai_stream(5)
    upstream.push(Script(chunks=chunks, headers=SSE_HEADERS))
    async with client.post(proxy.proxy_url + "/v1/chat/completions", json=CHAT) as response:
        body = await response.read()
        assert response.status == 200
        assert response.headers["Content-Type"] == SSE_HEADERS["Content-Type"]
        assert response.headers["X-LLM-Diag-Concurrency"] == "1"
        request_id = response.headers["X-Request-Id"]
    assert body == b"".join(chunks)
    await wait_records(proxy, 1)
    record = proxy.store.get(request_id)
    assert record is not None
    assert record.stop_reason == "eos"
    assert record.output_tokens == 5 and record.tokens_source == "usage"
    assert record.requested_max_tokens == 64
    assert record.model == "m" and record.stream is True
    assert record.bytes_out == len(body)


async def test_request_body_and_headers_reach_upstream_unchanged(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                                 client: aiohttp.ClientSession) -> None:
    raw = b'{"model":"m",  "messages":[],"stream":false}'
    upstream.push(Script(chunks=[openai_completion(3)], headers=JSON_HEADERS, content_length=True))
    async with client.post(proxy.proxy_url + "/v1/chat/completions?x=1", data=raw,
                           headers={"Content-Type": "application/json", "X-Custom": "kept",
                                    "Authorization": "Bearer secret"}) as response:
        await response.read()
    seen = upstream.seen[-1]
    assert seen.body == raw
    assert seen.path == "/v1/chat/completions?x=1"
    assert seen.headers["X-Custom"] == "kept"
    assert seen.headers["Authorization"] == "Bearer secret"


async def test_non_streaming_json_keeps_content_length(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                       client: aiohttp.ClientSession) -> None:
    body = openai_completion(4, "length")
    upstream.push(Script(chunks=[body], headers=JSON_HEADERS, content_length=True))
    async with client.post(proxy.proxy_url + "/v1/chat/completions",
                           json={**CHAT, "stream": False, "max_tokens": 4}) as response:
        assert await response.read() == body
        assert response.headers["Content-Length"] == str(len(body))
        request_id = response.headers["X-Request-Id"]
    await wait_records(proxy, 1)
    record = proxy.store.get(request_id)
    assert record is not None
    assert record.stop_reason == "length" and record.length_cause == "requested_budget"


async def test_ollama_ndjson_passes_and_is_read(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                client: aiohttp.ClientSession) -> None:
    chunks = ollama_stream(6)
    upstream.push(Script(chunks=chunks, headers=NDJSON_HEADERS))
    async with client.post(proxy.proxy_url + "/api/chat", json={"model": "llama3.2", "messages": []},
                           headers={"X-Request-Id": "mine-1"}) as response:
        assert await response.read() == b"".join(chunks)
        assert response.headers["X-Request-Id"] == "mine-1"
    await wait_records(proxy, 1)
    record = proxy.store.get("mine-1")
    assert record is not None
    assert record.dialect == "ollama" and record.stream is True  # Ollama streams by default
    assert record.stop_reason == "eos" and record.output_tokens == 6 and record.prompt_tokens == 26
    assert record.queue_time_s is not None and record.queue_time_source == "server_durations"


async def test_upstream_down_gives_json_502_and_a_record(make_proxy: object, client: aiohttp.ClientSession) -> None:
    assert callable(make_proxy)
    proxy = await make_proxy("http://127.0.0.1:9")
    async with client.post(proxy.proxy_url + "/v1/chat/completions", json=CHAT) as response:
        assert response.status == 502
        error = orjson.loads(await response.read())["error"]
    assert error["type"] == "upstream_unavailable"
    assert "127.0.0.1:9" in error["message"]
    await wait_records(proxy, 1)
    record = next(proxy.store.newest_first())
    assert record.stop_reason == "upstream_error" and record.upstream_error == "connect"
