"""The server's own account of each request, joined to the wire's (`serve --server-traces on`).

The fake vLLM exports its `llm_request` spans through the real OpenTelemetry SDK and OTLP/HTTP
exporter to the proxy's admin listener, as vLLM's `do_tracing` does; the official `openai` client
drives the requests."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from proxy.serve.app import RunningProxy
from tests.support.proxies import ProxyFactory, record_for
from tests.support.vllm_upstream import MODEL, FakeVllm

MESSAGES: Any = [{"role": "user", "content": "Tell me a long story about the sea."}]


@pytest.fixture
async def fake() -> AsyncIterator[FakeVllm]:
    server = FakeVllm()
    await server.start()
    yield server
    await server.close()


async def traced_proxy(fake: FakeVllm, make_proxy: ProxyFactory, **overrides: Any) -> RunningProxy:
    """A proxy that takes spans, and a fake vLLM that sends them there; back once the proxy has seen
    a first span (it expects them from then on)."""
    running = await make_proxy(fake.url, upstream_metrics="vllm", upstream_metrics_interval_s=0.1,
                               server_traces=True, server_traces_wait_s=overrides.pop("wait_s", 3.0), **overrides)
    fake.traces_to = running.admin_url + "/v1/traces"
    await ask(running, "warm-up", max_tokens=2)
    traces = running.serving.traces
    assert traces is not None
    for _ in range(300):
        if traces.expecting:
            break
        await asyncio.sleep(0.01)
    assert traces.expecting
    return running


async def ask(running: RunningProxy, rid: str, *, max_tokens: int | None = None, usage: bool = False,
              **headers: str) -> None:
    client = openai.AsyncOpenAI(base_url=running.proxy_url + "/v1", api_key="k", max_retries=0,
                                default_headers={"X-Request-Id": rid, **headers})
    extra: dict[str, Any] = {"stream_options": {"include_usage": True}} if usage else {}
    if max_tokens is not None:
        extra["max_tokens"] = max_tokens
    [c async for c in await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **extra)]


async def metric(running: RunningProxy, pattern: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(running.admin_url + "/metrics") as response:
        text = await response.text()
    return sum(float(v) for v in re.findall(rf"^{pattern} (\S+)$", text, re.MULTILINE))


async def test_a_budget_stop_without_usage_is_decided_by_the_servers_count(fake: FakeVllm,
                                                                           make_proxy: ProxyFactory) -> None:
    running = await traced_proxy(fake, make_proxy)
    await ask(running, "budget", max_tokens=40)
    record = await wait_joined(running, "budget")
    assert (record.stop_reason, record.length_cause, record.length_cause_source) == (
        "length", "requested_budget", "server_trace")
    assert (record.output_tokens, record.tokens_source, record.server_output_tokens) == (40, "server_trace", 40)
    assert (record.prompt_tokens_source, record.queue_time_source, record.server_times_source) == (
        "server_trace", "server_trace", "server_trace")
    assert record.undelivered is False and record.server_prefill_s is not None
    assert fake.tokenize_calls == 0, "the span decided: the tokenizer is not asked"
    await wait_joined(running, "warm-up")  # (its span may come after the budget's: the metric counts both)
    assert await metric(running, r'llm_proxy_server_spans_total\{result="joined"\}') >= 2


async def test_a_clamp_near_the_context_without_usage_is_the_servers_limit(fake: FakeVllm,
                                                                           make_proxy: ProxyFactory) -> None:
    fake.max_model_len = 60
    running = await traced_proxy(fake, make_proxy)
    await ask(running, "clamp", max_tokens=58)  # the prompt leaves fewer than 58
    record = await wait_joined(running, "clamp")
    assert (record.stop_reason, record.length_cause, record.length_cause_source) == (
        "length", "server_limit", "server_trace")
    assert record.output_tokens is not None and record.output_tokens < 58
    assert fake.tokenize_calls == 0


async def test_the_queue_time_of_requests_behind_max_num_seqs_is_the_servers(fake: FakeVllm,
                                                                            make_proxy: ProxyFactory) -> None:
    fake.max_num_seqs, fake.token_delay_s = 1, 0.005
    running = await traced_proxy(fake, make_proxy)
    await asyncio.gather(*(ask(running, f"queued-{i}", max_tokens=30, usage=True) for i in range(3)))
    records = [await wait_joined(running, f"queued-{i}") for i in range(3)]
    waits = sorted(r.queue_time_s or 0.0 for r in records)
    assert all(r.queue_time_source == "server_trace" for r in records)
    assert waits[-1] > 0.1, waits  # the last waited for two answers of 30 tokens at 5 ms
    assert await metric(running, r'llm_proxy_server_queue_seconds_count\{model="tiny"\}') >= 3


async def test_an_answer_the_server_finished_and_the_stream_lost_is_undelivered(fake: FakeVllm,
                                                                               make_proxy: ProxyFactory) -> None:
    running = await traced_proxy(fake, make_proxy)
    fake.break_after = 10
    with pytest.raises(openai.APIError):
        await ask(running, "cut-in-transit", max_tokens=40)
    record = await wait_joined(running, "cut-in-transit")
    assert (record.stop_reason, record.undelivered, record.cause, record.outcome) == (
        "upstream_disconnect", True, "undelivered", "cut")
    assert record.undelivered_detail is not None and "40 tokens" in record.undelivered_detail
    assert await metric(running, r'llm_proxy_undelivered_answers_total\{model="tiny"\}') == 1


async def test_the_servers_time_after_its_client_left(fake: FakeVllm, make_proxy: ProxyFactory) -> None:
    fake.ignore_disconnect, fake.token_delay_s = True, 0.01
    running = await traced_proxy(fake, make_proxy)
    client = openai.AsyncOpenAI(base_url=running.proxy_url + "/v1", api_key="k", max_retries=0,
                                default_headers={"X-Request-Id": "left"})
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, max_tokens=100)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    await stream.close()  # the client leaves after its first token; the server goes on for ~1 s
    record = await wait_joined(running, "left")
    assert record.client_disconnected and record.server_aborted is False
    assert record.server_after_disconnect_s is not None and record.server_after_disconnect_s > 0.3
    assert await metric(running, r'llm_proxy_server_after_disconnect_seconds_count\{model="tiny"\}') == 1


async def test_a_request_the_server_aborted_has_no_span_and_says_so(fake: FakeVllm, make_proxy: ProxyFactory) -> None:
    fake.token_delay_s = 0.01
    running = await traced_proxy(fake, make_proxy, wait_s=0.5)
    client = openai.AsyncOpenAI(base_url=running.proxy_url + "/v1", api_key="k", max_retries=0,
                                default_headers={"X-Request-Id": "aborted"})
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, max_tokens=100)
    async for _ in stream:
        break
    await stream.close()
    record = await wait_for(running, "aborted", lambda r: r.server_trace is not None)
    assert (record.server_trace, record.server_aborted) == ("missing", None)
    assert record.server_trace_detail is not None and "aborted" in record.server_trace_detail


async def test_before_any_span_the_tokenizer_decides_as_without_traces(fake: FakeVllm,
                                                                       make_proxy: ProxyFactory) -> None:
    running = await make_proxy(fake.url, upstream_metrics="vllm", server_traces=True)
    await ask(running, "first", max_tokens=20)
    record = await wait_for(running, "first", lambda r: r.length_cause_source == "server_tokenizer")
    assert (record.length_cause, record.server_trace) == ("requested_budget", None)
    assert fake.tokenize_calls == 1


async def test_the_receiver_is_bounded_and_guarded(fake: FakeVllm, make_proxy: ProxyFactory) -> None:
    running = await make_proxy(fake.url, server_traces=True, admin_token="s3cret")
    url, auth = running.admin_url + "/v1/traces", {"Authorization": "Bearer s3cret"}
    async with aiohttp.ClientSession() as session:
        async with session.post(url, data=b"", headers={"Content-Type": "application/x-protobuf"}) as response:
            assert response.status == 401
        async with session.post(url, data=b"\xff\x01garbage", headers={
                **auth, "Content-Type": "application/x-protobuf"}) as response:
            assert response.status == 400 and (await response.json())["error"]["code"] == "not_traces"
        async with session.post(url, data=b"{}", headers={**auth, "Content-Type": "text/plain"}) as response:
            assert response.status == 415  # what a web page could post across origins is refused
        async with session.post(url, data=b"{}", headers={**auth, "Content-Type": "application/json",
                                                          "Host": "rebound.example"}) as response:
            assert response.status == 403
        async with session.post(url, data=b"0" * (5 * 1024 * 1024), headers={
                **auth, "Content-Type": "application/x-protobuf"}) as response:
            assert response.status == 413
        # OTLP JSON: a span of a request the proxy never saw waits, then is counted unmatched
        body = {"resourceSpans": [{"scopeSpans": [{"spans": [
            {"traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174", "name": "llm_request",
             "startTimeUnixNano": "1796000000000000000", "endTimeUnixNano": "1796000001000000000",
             "attributes": [{"key": "gen_ai.request.id", "value": {"stringValue": "chatcmpl-nobody"}},
                            {"key": "gen_ai.usage.completion_tokens", "value": {"intValue": "12"}}]},
            {"traceId": "5b8efff798038103d269b633813fc60d", "spanId": "eee19b7ec3c1b175", "name": "http get",
             "startTimeUnixNano": "1796000000000000000", "endTimeUnixNano": "1796000001000000000"}]}]}]}
        async with session.post(url, data=orjson.dumps(body), headers={
                **auth, "Content-Type": "application/json"}) as response:
            assert response.status == 200 and await response.json() == {}
    traces = running.serving.traces
    assert traces is not None and traces.expecting
    assert await metric(running, r'llm_proxy_server_spans_total\{result="not_request"\}') == 1


async def test_without_server_traces_the_receiver_is_not_there(fake: FakeVllm, make_proxy: ProxyFactory) -> None:
    running = await make_proxy(fake.url)
    async with aiohttp.ClientSession() as session, session.post(running.admin_url + "/v1/traces",
                                                                data=b"") as response:
        assert response.status == 404 and "--server-traces on" in (await response.json())["error"]["message"]


async def test_vllms_per_request_metrics_in_the_answer_give_the_queue_time(fake: FakeVllm,
                                                                           make_proxy: ProxyFactory) -> None:
    fake.metrics_in_answer = True
    running = await make_proxy(fake.url)
    await ask(running, "metrics", max_tokens=10, usage=True)
    record = await record_for(running, "metrics")
    assert (record.queue_time_source, record.server_times_source) == ("server_metrics", "server_metrics")
    assert record.queue_time_s is not None and record.server_decode_s is not None


async def wait_joined(running: RunningProxy, rid: str) -> Any:
    return await wait_for(running, rid, lambda r: r.server_trace == "joined")


async def wait_for(running: RunningProxy, rid: str, done: Any, timeout_s: float = 10.0) -> Any:
    """The record once `done` holds (a record waiting for its span is delivered when it comes)."""
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout_s
    while True:
        record = running.store.get(rid)
        if record is not None and done(record):
            return record
        if loop.time() > until:
            raise AssertionError(f"{rid}: {record}")
        await asyncio.sleep(0.02)


async def test_with_workers_every_worker_hears_the_spans_and_joins_its_own(fake: FakeVllm, tmp_path: Any) -> None:
    """`--workers 2`: the supervisor's admin listener takes the spans and tells every worker; the worker
    that made a record joins it, and the record (read through the supervisor) says so."""
    from tests.support.proxies import start_served

    served = await start_served(fake.url, tmp_path, "--server-traces", "on", "--server-traces-wait", "5s",
                                workers=2)
    try:
        fake.traces_to = served.admin_url + "/v1/traces"
        client = openai.AsyncOpenAI(base_url=served.proxy_url + "/v1", api_key="k", max_retries=0)
        for n in range(6):  # the first spans make every worker expect them; later records wait for theirs
            [c async for c in await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, stream=True, max_tokens=12, extra_headers={"X-Request-Id": f"w-{n}"})]
            await asyncio.sleep(0.3)
        async with aiohttp.ClientSession() as session:
            for _ in range(100):
                async with session.get(served.admin_url + "/api/requests/w-5") as response:
                    found = await response.json() if response.status == 200 else {}
                if found.get("server_trace") == "joined":
                    break
                await asyncio.sleep(0.1)
        assert (found.get("server_trace"), found.get("length_cause_source")) == ("joined", "server_trace"), found
    finally:
        served.stop()
