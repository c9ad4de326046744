"""The official `openai` and `ollama` Python clients work unchanged through the proxy."""

from __future__ import annotations

import ollama
import openai
import pytest

from proxy.app import RunningProxy
from tests.support.proxies import record_for
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.wire import JSON_HEADERS, NDJSON_HEADERS, ollama_stream, openai_completion, openai_stream


async def test_openai_client_streaming(upstream: ScriptedUpstream, proxy: RunningProxy) -> None:
    upstream.push(Script(openai_stream(4, "length"), delay=0.002))
    client = openai.AsyncOpenAI(base_url=proxy.proxy_url + "/v1", api_key="sk-test", max_retries=0)
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Request-Id": "oa-stream"})
    text, finish = "", None
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    await client.close()
    assert text == "t0 t1 t2 t3 " and finish == "length"
    record = await record_for(proxy, "oa-stream")
    assert record.stop_reason == "length" and record.length_cause == "requested_budget"
    assert upstream.seen[-1].headers["Authorization"] == "Bearer sk-test"


async def test_openai_client_non_streaming(upstream: ScriptedUpstream, proxy: RunningProxy) -> None:
    upstream.push(Script([openai_completion(3)], headers=JSON_HEADERS, content_length=True))
    client = openai.AsyncOpenAI(base_url=proxy.proxy_url + "/v1", api_key="sk-test", max_retries=0)
    completion = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    await client.close()
    assert completion.choices[0].finish_reason == "stop" and completion.usage is not None
    assert completion.usage.completion_tokens == 3


async def test_openai_client_sees_the_upstream_429(upstream: ScriptedUpstream, proxy: RunningProxy) -> None:
    body = b'{"error": {"message": "queue full", "type": "rate_limit_error", "code": 429}}'
    upstream.push(Script([body], status=429, headers=JSON_HEADERS, content_length=True))
    client = openai.AsyncOpenAI(base_url=proxy.proxy_url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        await client.chat.completions.create(model="m", messages=[])
    await client.close()


async def test_ollama_client_streaming_chat(upstream: ScriptedUpstream, proxy: RunningProxy) -> None:
    upstream.push(Script(ollama_stream(5, "length"), headers=NDJSON_HEADERS, delay=0.002))
    client = ollama.AsyncClient(host=proxy.proxy_url, headers={"X-Request-Id": "ol-stream"})
    parts = [part async for part in await client.chat(
        model="llama3.2", messages=[{"role": "user", "content": "hi"}], stream=True,
        options={"num_predict": 5})]
    assert "".join(p.message.content or "" for p in parts) == "t0 t1 t2 t3 t4 "
    assert parts[-1].done and parts[-1].done_reason == "length"
    record = await record_for(proxy, "ol-stream")
    assert record.stop_reason == "length" and record.length_cause == "requested_budget"


async def test_ollama_client_non_streaming_generate(upstream: ScriptedUpstream, proxy: RunningProxy) -> None:
    final = ollama_stream(0, chat=False)[-1]
    upstream.push(Script([final], headers=JSON_HEADERS, content_length=True))
    client = ollama.AsyncClient(host=proxy.proxy_url)
    result = await client.generate(model="llama3.2", prompt="hi", stream=False)
    assert result.done and result.eval_count == 0
