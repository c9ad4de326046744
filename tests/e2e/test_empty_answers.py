"""Answers that were never generated, through the proxy with the official `openai` client: a 200
stream that says "stop" without one piece of output (LM Studio over its context,
lmstudio-ai/lmstudio-bug-tracker#2339: "HTTP 200 with a well-formed response/stream that contains
zero content deltas. Usage counts show tokens; no text arrives"), and an error body sent with a 200
(#2322). The client gets the bytes as they came; the record does not call them an answer."""

from __future__ import annotations

import openai
import orjson

from tests.support.proxies import ProxyFactory, record_for
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.wire import DONE, chat_chunk, sse, usage_chunk

CHAT = [{"role": "user", "content": "Summarise this long document ..."}]


async def test_a_200_stream_without_one_piece_of_output_is_not_generated(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory) -> None:
    stream = [sse(chat_chunk("", role=True)), sse(chat_chunk(None, "stop")), sse(usage_chunk(36_000, 3)), DONE]
    upstream.push(Script(chunks=stream))
    proxy = await make_proxy(upstream.url)
    client = openai.AsyncOpenAI(base_url=proxy.proxy_url + "/v1", api_key="k", max_retries=0,
                                default_headers={"X-Request-Id": "empty"})
    chunks = [chunk async for chunk in await client.chat.completions.create(
        model="m", messages=CHAT, stream=True, stream_options={"include_usage": True})]  # type: ignore[arg-type]
    assert chunks[1].choices[0].finish_reason == "stop"  # to the client, an answer that said nothing
    record = await record_for(proxy, "empty")
    assert (record.stop_reason, record.outcome, record.finish_reason_raw) == ("not_generated", "cut", "stop")
    assert record.stop_detail is not None and "without one piece of output" in record.stop_detail


async def test_an_error_body_with_status_200_is_an_upstream_error(upstream: ScriptedUpstream,
                                                                  make_proxy: ProxyFactory) -> None:
    message = ("Trying to keep the first 40000 tokens when context the overflows. However, the model is loaded "
               "with context length of only 32768 tokens, which is not enough.")
    upstream.push(Script(chunks=[orjson.dumps({"error": message})], headers={"Content-Type": "application/json"}))
    proxy = await make_proxy(upstream.url)
    client = openai.AsyncOpenAI(base_url=proxy.proxy_url + "/v1", api_key="k", max_retries=0,
                                default_headers={"X-Request-Id": "error-200"})
    await client.chat.completions.create(model="m", messages=CHAT)  # type: ignore[arg-type]
    record = await record_for(proxy, "error-200")
    assert (record.status, record.stop_reason, record.upstream_error) == (200, "upstream_error", "exceeds_context")
