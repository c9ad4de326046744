"""Each canonical stop reason, from a scenario on the wire that really produces it."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from proxy.serve.app import RunningProxy
from tests.support.proxies import ProxyFactory, record_for
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.wire import (
    DONE,
    JSON_HEADERS,
    NDJSON_HEADERS,
    SSE_HEADERS,
    chat_chunk,
    ollama_stream,
    openai_stream,
    sse,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 64}
CHAT_URL = "/v1/chat/completions"


async def exchange(client: aiohttp.ClientSession, proxy: RunningProxy, script: Script, upstream: ScriptedUpstream,
                   body: dict[str, object] | None = None, path: str = CHAT_URL) -> tuple[int, bytes, object]:
    upstream.push(script)
    async with client.post(proxy.proxy_url + path, json=body or CHAT) as response:
        data = await response.read()
        rid = response.headers["X-Request-Id"]
    return response.status, data, await record_for(proxy, rid)


async def test_finish_stop_without_stop_reason_is_eos(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                      client: aiohttp.ClientSession) -> None:
    _, _, record = await exchange(client, proxy, Script(openai_stream(3)), upstream)
    assert record.stop_reason == "eos" and record.finish_reason_raw == "stop"


async def test_vllm_stop_reason_string_is_stop_sequence(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                        client: aiohttp.ClientSession) -> None:
    _, _, record = await exchange(client, proxy, Script(openai_stream(3, stop_reason="\n\n")), upstream)
    assert record.stop_reason == "stop_sequence"


async def test_length_at_requested_budget_is_requested_budget(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                              client: aiohttp.ClientSession) -> None:
    _, _, record = await exchange(client, proxy, Script(openai_stream(64, "length")), upstream)
    assert record.stop_reason == "length" and record.length_cause == "requested_budget"


async def test_length_stop_below_requested_budget_is_server_limit(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                                  client: aiohttp.ClientSession) -> None:
    _, _, record = await exchange(client, proxy, Script(openai_stream(10, "length")), upstream)
    assert record.stop_reason == "length" and record.length_cause == "server_limit"
    assert record.output_tokens == 10 and record.requested_max_tokens == 64
    assert record.truncation_cause == "server_limit"


async def test_counted_tokens_below_the_budget_leave_the_length_cause_unknown(
        upstream: ScriptedUpstream, proxy: RunningProxy, client: aiohttp.ClientSession) -> None:
    _, _, record = await exchange(client, proxy, Script(openai_stream(9, "length", usage=False)), upstream)
    assert record.output_tokens == 9 and record.tokens_source == "counted"
    assert record.length_cause == "unknown" and record.truncation_cause != "server_limit"


async def test_counted_tokens_reaching_the_budget_prove_the_requested_budget(
        upstream: ScriptedUpstream, proxy: RunningProxy, client: aiohttp.ClientSession) -> None:
    _, _, record = await exchange(client, proxy, Script(openai_stream(64, "length", usage=False)), upstream)
    assert (record.tokens_source, record.length_cause) == ("counted", "requested_budget")


async def test_a_budget_stop_whose_chunks_undercount_is_never_a_server_limit(
        upstream: ScriptedUpstream, proxy: RunningProxy, client: aiohttp.ClientSession) -> None:
    """vLLM under load: 64 tokens in 40 chunks, some with several tokens, some `"content": ""`."""
    chunks = [sse(chat_chunk("", role=True))]
    chunks += [sse(chat_chunk("" if i % 5 == 0 else "tok tok")) for i in range(39)]
    chunks += [sse(chat_chunk("end", "length")), DONE]
    _, _, record = await exchange(client, proxy, Script(chunks), upstream)
    assert record.stop_reason == "length" and record.tokens_source == "counted"
    assert record.output_tokens is not None and record.output_tokens < 64
    assert record.length_cause == "unknown" and record.truncation_cause != "server_limit"


async def test_llamacpp_timings_give_the_servers_own_token_count(
        upstream: ScriptedUpstream, proxy: RunningProxy, client: aiohttp.ClientSession) -> None:
    """llama-server's OpenAI stream sends no usage unless asked, but `timings.predicted_n` always."""
    final = chat_chunk(None, "length")
    del final["choices"][0]["stop_reason"]
    final["timings"] = {"prompt_n": 5, "prompt_ms": 1.0, "predicted_n": 64, "predicted_ms": 20.0}
    chunks = [sse(chat_chunk("", role=True)), *(sse(chat_chunk("x")) for _ in range(50)), sse(final), DONE]
    _, _, record = await exchange(client, proxy, Script(chunks), upstream)
    assert (record.output_tokens, record.tokens_source, record.length_cause) == (64, "usage", "requested_budget")


async def test_tool_calls_and_content_filter(upstream: ScriptedUpstream, proxy: RunningProxy,
                                             client: aiohttp.ClientSession) -> None:
    _, _, record = await exchange(client, proxy, Script(openai_stream(2, "tool_calls")), upstream)
    assert record.stop_reason == "tool_calls" and not record.truncated
    _, _, record = await exchange(client, proxy, Script(openai_stream(2, "content_filter")), upstream)
    assert record.stop_reason == "content_filter" and record.truncated


async def test_vllm_abort_is_an_upstream_error(upstream: ScriptedUpstream, proxy: RunningProxy,
                                               client: aiohttp.ClientSession) -> None:
    _, _, record = await exchange(client, proxy, Script(openai_stream(2, "abort")), upstream)
    assert record.stop_reason == "upstream_error" and record.upstream_error == "abort"


async def test_vllm_abort_before_the_first_token_is_an_interruption(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                                    client: aiohttp.ClientSession) -> None:
    """vLLM 0.32 aborted before its first token: the role chunk, then [DONE], and no finish_reason."""
    role = (b'data: {"id":"chatcmpl-2a9d","object":"chat.completion.chunk","created":1796407287,"model":"tiny",'
            b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
            b'"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}\n\n')
    _, data, record = await exchange(client, proxy, Script([role, DONE]), upstream)
    assert data == role + DONE
    assert (record.stop_reason, record.finish_reason_raw, record.output_tokens) == ("interrupted", None, 0)
    assert record.truncated


async def test_vllm_repetition_is_its_own_stop_and_a_cut(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                          client: aiohttp.ClientSession) -> None:
    _, _, record = await exchange(client, proxy, Script(openai_stream(20, "repetition")), upstream)
    assert (record.stop_reason, record.finish_reason_raw) == ("repetition", "repetition")
    assert record.truncated and record.truncation_cause == "repetition"


async def test_vllm_error_finish_is_an_upstream_error(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                       client: aiohttp.ClientSession) -> None:
    _, _, record = await exchange(client, proxy, Script(openai_stream(3, "error")), upstream)
    assert (record.stop_reason, record.upstream_error) == ("upstream_error", "error_event")


@pytest.mark.parametrize("status", [429, 503])
async def test_429_and_503_are_rejected(status: int, upstream: ScriptedUpstream, proxy: RunningProxy,
                                        client: aiohttp.ClientSession) -> None:
    body = b'{"error": {"message": "Too many requests", "type": "rate_limit", "code": 429}}'
    got, data, record = await exchange(
        client, proxy, Script([body], status=status, headers=JSON_HEADERS, content_length=True), upstream)
    assert got == status and data == body
    assert record.stop_reason == "rejected" and record.upstream_error is None
    assert record.upstream_error_detail == "Too many requests"


async def test_http_500_with_oom_message_is_oom(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                client: aiohttp.ClientSession) -> None:
    body = b'{"error": "CUDA out of memory. Tried to allocate 2.00 GiB"}'
    _, _, record = await exchange(
        client, proxy, Script([body], status=500, headers=JSON_HEADERS, content_length=True), upstream)
    assert record.stop_reason == "upstream_error" and record.upstream_error == "oom"


async def test_mid_stream_error_event_with_oom_message_is_oom(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                              client: aiohttp.ClientSession) -> None:
    chunks = openai_stream(3)[:3] + [sse({"error": {"object": "error", "message": "CUDA out of memory",
                                                    "type": "InternalServerError", "code": 500}}), DONE]
    _, data, record = await exchange(client, proxy, Script(chunks), upstream)
    assert data == b"".join(chunks)
    assert record.stop_reason == "upstream_error" and record.upstream_error == "oom"
    assert record.output_tokens == 2  # counted: the role chunk carries no content


async def test_mid_stream_error_event_without_oom_is_error_event(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                                 client: aiohttp.ClientSession) -> None:
    chunks = [*openai_stream(2)[:2], sse({"error": {"message": "engine dead", "type": "x"}})]
    _, _, record = await exchange(client, proxy, Script(chunks), upstream)
    assert record.upstream_error == "error_event" and record.upstream_error_detail == "engine dead"


async def test_stream_ending_without_final_event_is_upstream_disconnect(
        upstream: ScriptedUpstream, proxy: RunningProxy, client: aiohttp.ClientSession) -> None:
    _, _, record = await exchange(client, proxy, Script(openai_stream(5)[:4]), upstream)
    assert record.stop_reason == "upstream_disconnect" and record.upstream_error is None


async def test_upstream_reset_mid_stream_is_upstream_disconnect_and_breaks_client(
        upstream: ScriptedUpstream, proxy: RunningProxy, client: aiohttp.ClientSession) -> None:
    upstream.push(Script(openai_stream(5)[:4], end="reset"))
    received = b""
    async with client.post(proxy.proxy_url + CHAT_URL, json=CHAT) as response:
        rid = response.headers["X-Request-Id"]
        with pytest.raises(aiohttp.ClientPayloadError):
            async for chunk in response.content.iter_any():
                received += chunk
    assert received == b"".join(openai_stream(5)[:4])  # every byte that came, nothing more
    record = await record_for(proxy, rid)
    assert record.stop_reason == "upstream_disconnect" and record.upstream_error == "reset"


async def test_client_disconnect_mid_stream_cancels_upstream(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                             client: aiohttp.ClientSession) -> None:
    upstream.push(Script(openai_stream(50), delay=0.05))
    async with client.post(proxy.proxy_url + CHAT_URL, json=CHAT) as response:
        rid = response.headers["X-Request-Id"]
        await response.content.readuntil(b"t2 ")
        response.close()  # the client gives up
    await asyncio.wait_for(upstream.seen[-1].disconnected.wait(), 5)
    record = await record_for(proxy, rid)
    assert record.stop_reason == "client_disconnect" and record.disconnect_phase == "mid_stream"
    assert record.client_disconnected and 2 <= record.output_tokens < 50


async def test_a_client_that_closes_on_the_finish_before_done_got_a_whole_answer(
        upstream: ScriptedUpstream, proxy: RunningProxy, client: aiohttp.ClientSession) -> None:
    # Some clients stop reading at the finish chunk and close without waiting for the usage chunk
    # and [DONE]: the answer ended where the model ended it; that the client left after is kept.
    upstream.push(Script(openai_stream(3), delay=0.1))
    async with client.post(proxy.proxy_url + CHAT_URL, json=CHAT) as response:
        rid = response.headers["X-Request-Id"]
        await response.content.readuntil(b'"finish_reason":"stop"')
        await response.content.readuntil(b"\n\n")
        response.close()
    await asyncio.wait_for(upstream.seen[-1].disconnected.wait(), 5)
    record = await record_for(proxy, rid)
    assert record.stop_reason == "eos" and record.outcome == "complete" and record.output_tokens == 3
    assert record.client_disconnected and record.disconnect_phase == "mid_stream"


async def test_client_disconnect_before_first_token(upstream: ScriptedUpstream, proxy: RunningProxy) -> None:
    upstream.push(Script(openai_stream(3), first_delay=0.5))
    async with aiohttp.ClientSession() as session:
        with pytest.raises(TimeoutError):
            await session.post(proxy.proxy_url + CHAT_URL, json=CHAT, headers={"X-Request-Id": "gone-early"},
                               timeout=aiohttp.ClientTimeout(total=0.2))
    record = await record_for(proxy, "gone-early")
    assert record.stop_reason == "client_disconnect" and record.disconnect_phase == "before_first_token"


async def test_enforced_idle_timeout_ends_stream_visibly(upstream: ScriptedUpstream, make_proxy: ProxyFactory,
                                                         client: aiohttp.ClientSession) -> None:
    proxy = await make_proxy(upstream.url, idle_timeout_s=0.2, deadline_mode="enforce")
    head = openai_stream(5)[:3]
    status, data, record = await exchange(client, proxy, Script(head, end="hang"), upstream)
    assert status == 200 and data.startswith(b"".join(head))
    tail = data[len(b"".join(head)):]
    assert tail.startswith(b"data: ") and b"[DONE]" not in tail
    assert orjson.loads(tail[6:])["error"]["type"] == "idle_timeout"
    assert record.stop_reason == "idle_timeout"
    assert record.deadline_hit == "idle" and record.deadline_mode == "enforce"
    await asyncio.wait_for(upstream.seen[-1].disconnected.wait(), 5)


async def test_enforced_total_deadline_ends_ndjson_visibly(upstream: ScriptedUpstream, make_proxy: ProxyFactory,
                                                           client: aiohttp.ClientSession) -> None:
    proxy = await make_proxy(upstream.url, deadline_s=0.3, deadline_mode="enforce")
    script = Script(ollama_stream(100), headers=NDJSON_HEADERS, delay=0.02)
    _, data, record = await exchange(client, proxy, script, upstream, {"model": "x"}, "/api/generate")
    last = orjson.loads(data.rstrip(b"\n").rsplit(b"\n", 1)[-1])
    assert last["error"]["type"] == "deadline_exceeded"
    assert record.stop_reason == "deadline" and record.deadline_hit == "total"


async def test_enforced_deadline_before_headers_is_504(upstream: ScriptedUpstream, make_proxy: ProxyFactory,
                                                       client: aiohttp.ClientSession) -> None:
    proxy = await make_proxy(upstream.url, deadline_s=0.2, deadline_mode="enforce")
    status, data, record = await exchange(client, proxy, Script(openai_stream(2), first_delay=2), upstream)
    assert status == 504 and orjson.loads(data)["error"]["type"] == "deadline_exceeded"
    assert record.stop_reason == "deadline"


async def test_observed_deadline_is_recorded_without_cutting(upstream: ScriptedUpstream, make_proxy: ProxyFactory,
                                                             client: aiohttp.ClientSession) -> None:
    proxy = await make_proxy(upstream.url, deadline_s=0.1, idle_timeout_s=5)
    chunks = openai_stream(6)
    _, data, record = await exchange(client, proxy, Script(chunks, delay=0.03), upstream)
    assert data == b"".join(chunks)
    assert record.stop_reason == "eos"
    assert record.deadline_hit == "total" and record.deadline_mode == "observe"


async def test_ollama_length_below_num_predict_is_server_limit(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                               client: aiohttp.ClientSession) -> None:
    script = Script(ollama_stream(12, "length"), headers=NDJSON_HEADERS)
    body = {"model": "llama3.2", "messages": [], "options": {"num_predict": 100, "num_ctx": 2048}}
    _, _, record = await exchange(client, proxy, script, upstream, body, "/api/chat")
    assert record.stop_reason == "length" and record.length_cause == "server_limit"
    assert record.num_ctx == 2048


async def test_pass_through_request_is_not_inference(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                     client: aiohttp.ClientSession) -> None:
    body = b'{"object": "list", "data": []}'
    upstream.push(Script([body], headers=JSON_HEADERS, content_length=True))
    async with client.get(proxy.proxy_url + "/v1/models") as response:
        assert await response.read() == body
        rid = response.headers["X-Request-Id"]
    record = await record_for(proxy, rid)
    assert record.stop_reason == "not_inference" and record.route == "other"


async def test_garbage_is_forwarded_and_recorded_as_parse_error(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                                client: aiohttp.ClientSession) -> None:
    garbage = [b"data: {not json\n\n", b"\xff\xfe\x00binary\n\n", b"data: [1,2\n\n"]
    status, data, record = await exchange(client, proxy, Script(garbage), upstream)
    assert status == 200 and data == b"".join(garbage)
    assert record.parse_error and record.stop_reason == "unknown"


async def test_ten_mib_line_without_newline_passes_and_is_parse_error(
        upstream: ScriptedUpstream, proxy: RunningProxy, client: aiohttp.ClientSession) -> None:
    huge = [b"data: " + b"x" * (1 << 20) for _ in range(10)]
    _, data, record = await exchange(client, proxy, Script(huge), upstream)
    assert data == b"".join(huge)
    assert record.parse_error


async def test_sse_with_crlf_comments_and_multiline_data(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                         client: aiohttp.ClientSession) -> None:
    final = orjson.dumps(chat_chunk(None, "length"))
    chunks = [b": keep-alive\r\n\r\n", sse(chat_chunk("a")).replace(b"\n", b"\r\n"),
              b"data: " + final[:19] + b"\r\ndata: " + final[19:] + b"\r\n\r\n", b"data: [DONE]\r\n\r\n"]
    _, _, record = await exchange(client, proxy, Script(chunks), upstream)
    assert record.stop_reason == "length" and not record.parse_error


async def test_gzip_encoded_body_is_forwarded_encoded_and_still_read(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                                     client: aiohttp.ClientSession) -> None:
    import gzip

    body = gzip.compress(b"".join(openai_stream(4, "length")))
    script = Script([body[:30], body[30:]], headers={**SSE_HEADERS, "Content-Encoding": "gzip"})
    _, data, record = await exchange(client, proxy, script, upstream)
    assert data == body
    assert record.stop_reason == "length" and record.output_tokens == 4
