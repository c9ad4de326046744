"""Property: whatever the chunking, the client gets the upstream's bytes and the diagnosis is the same."""

from __future__ import annotations

import asyncio

import aiohttp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.serve.app import start_proxy
from tests.support.chunking import split_at
from tests.support.proxies import proxy_config
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.wire import (
    JSON_HEADERS,
    NDJSON_HEADERS,
    SSE_HEADERS,
    anthropic_message,
    anthropic_stream,
    ollama_stream,
    openai_completion,
    openai_stream,
    responses_body,
    responses_stream,
)

CASES = [
    ("/v1/chat/completions", SSE_HEADERS, b"".join(openai_stream(12, "length")), "length"),
    ("/v1/chat/completions", SSE_HEADERS, b"".join(openai_stream(5)).replace(b"\n", b"\r\n"), "eos"),
    ("/api/chat", NDJSON_HEADERS, b"".join(ollama_stream(9)), "eos"),
    ("/api/generate", NDJSON_HEADERS, b"".join(ollama_stream(4, "length", chat=False)), "length"),
    ("/v1/chat/completions", JSON_HEADERS, openai_completion(6, "stop"), "eos"),
    ("/v1/messages", SSE_HEADERS, b"".join(anthropic_stream(12, "max_tokens", thinking=3)), "length"),
    ("/v1/messages", SSE_HEADERS, b"".join(anthropic_stream(5, stop_sequence="###")).replace(b"\n", b"\r\n"),
     "stop_sequence"),
    ("/v1/messages", JSON_HEADERS, anthropic_message(4, "end_turn"), "eos"),
    ("/v1/responses", SSE_HEADERS, b"".join(responses_stream(7, "incomplete", reason="max_output_tokens",
                                                             reasoning=2)), "length"),
    ("/v1/responses", SSE_HEADERS, b"".join(responses_stream(6)), "eos"),
    ("/v1/responses", JSON_HEADERS, responses_body(3), "eos"),
]


async def roundtrip(path: str, headers: dict[str, str], chunks: list[bytes], content_length: bool) -> tuple[bytes, str]:
    upstream = ScriptedUpstream()
    await upstream.start()
    proxy = await start_proxy(proxy_config(upstream.url))
    try:
        upstream.push(Script(chunks, headers=headers, delay=0.0005, content_length=content_length))
        async with aiohttp.ClientSession(auto_decompress=False) as session, session.post(
                proxy.proxy_url + path, json={"model": "m", "max_tokens": 12, "options": {"num_predict": 4}},
                headers={"X-Request-Id": "prop"}) as response:
            body = await response.read()
        for _ in range(100):
            record = proxy.store.get("prop")
            if record is not None:
                return body, record.stop_reason
            await asyncio.sleep(0.01)
        raise AssertionError("no record")
    finally:
        await proxy.close()
        await upstream.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(CASES), st.lists(st.integers(min_value=0, max_value=5000), max_size=25), st.booleans())
def test_bytes_and_diagnosis_survive_any_chunking(case: tuple[str, dict[str, str], bytes, str], cuts: list[int],
                                                  content_length: bool) -> None:
    path, headers, data, expected = case
    body, stop_reason = asyncio.run(roundtrip(path, headers, split_at(data, cuts), content_length))
    assert body == data
    assert stop_reason == expected
