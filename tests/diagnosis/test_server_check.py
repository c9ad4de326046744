"""What the proxy asks its upstream after a response: what server it is, and its tokenizer's count of a
prompt whose length stop the wire left open; bounded, off the relay path, invisible in the records."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from proxy.diagnosis.prompt_rules import PromptCount
from proxy.diagnosis.recorder import Recorder
from proxy.diagnosis.server_check import ServerCheck, ServerTokenizer
from proxy.diagnosis.tokenizer_queue import QueueLimits
from proxy.observers.hooks import Observer
from proxy.record import ResponseRecord
from proxy.serve.app import RunningProxy, start_proxy
from proxy.servers.base import ServerIdentity, ServerInfo, TokenizerQuery, TokenizerUnavailable
from proxy.servers.identity import IdentityPoller, read_identity
from tests.support.proxies import ProxyFactory, proxy_config, record_for
from tests.support.vllm_upstream import MODEL, FakeVllm

PROMPT = [{"role": "user", "content": "tell me a long story"}]  # 2 + 5 words + 2 = 9 tokens


@pytest.fixture
async def vllm() -> AsyncIterator[FakeVllm]:
    server = FakeVllm()
    await server.start()
    yield server
    await server.close()


async def asking_proxy(make_proxy: ProxyFactory, upstream: FakeVllm, **overrides: Any) -> RunningProxy:
    """A proxy that probes its upstream (`--upstream-metrics` on), once it has identified it."""
    running = await make_proxy(upstream.url, upstream_metrics="vllm", upstream_metrics_interval_s=5.0, **overrides)
    assert running.check is not None
    for _ in range(300):
        if running.check.identity.kind == "vllm":
            return running
        await asyncio.sleep(0.01)
    raise AssertionError("the proxy never identified its upstream")


async def stream(running: RunningProxy, rid: str, max_tokens: int | None, *, usage: bool = False,
                 messages: list[dict[str, str]] = PROMPT) -> float:
    """One streamed chat with the official client; the seconds until its last byte."""
    client = openai.AsyncOpenAI(base_url=running.proxy_url + "/v1", api_key="sk-client", max_retries=0)
    started = time.monotonic()
    events = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True} if usage else None, extra_headers={"X-Request-Id": rid})
    async for _ in events:
        pass
    took = time.monotonic() - started
    await client.close()
    return took


async def samples(running: RunningProxy, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    async with aiohttp.ClientSession() as session, session.get(running.admin_url + "/metrics") as response:
        text = await response.text()
    return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


# --- through the proxy ------------------------------------------------------------------------------

async def test_a_counted_budget_stop_is_decided_by_the_servers_tokenizer(
        vllm: FakeVllm, make_proxy: ProxyFactory) -> None:
    running = await asking_proxy(make_proxy, vllm)
    await stream(running, "budget", 200)
    record = await record_for(running, "budget")
    assert (record.stop_reason, record.tokens_source) == ("length", "counted")
    assert record.output_tokens is not None and record.output_tokens < 200  # the "" chunks show no text
    assert (record.length_cause, record.length_cause_source) == ("requested_budget", "server_tokenizer")
    assert (record.prompt_tokens, record.prompt_tokens_source, record.context_tokens) == (9, "tokenizer", 512)
    assert record.length_cause_detail is not None and "vLLM POST /tokenize" in record.length_cause_detail
    assert (record.cause, record.outcome) == ("requested_budget", "budget")
    # the tokenizer call is not client traffic: one record, one request counted, the call counted apart
    assert len(running.store) == 1 and vllm.tokenize_calls == 1
    requests = await samples(running, "llm_proxy_requests_total")
    assert sum(requests.values()) == 1
    assert (await samples(running, "llm_proxy_server_tokenizer_requests_total"))[(("result", "decided"),)] == 1


async def test_a_budget_the_context_cut_is_a_server_limit_by_the_tokenizer(
        vllm: FakeVllm, make_proxy: ProxyFactory) -> None:
    running = await asking_proxy(make_proxy, vllm)
    await stream(running, "clamp", 508)  # 9 prompt tokens + 508 > 512: vLLM generated 503
    record = await record_for(running, "clamp")
    assert (record.length_cause, record.length_cause_source) == ("server_limit", "server_tokenizer")
    assert record.length_cause_detail is not None and "cut the budget to 503" in record.length_cause_detail


async def test_the_record_reaches_the_observers_once_with_its_final_cause(vllm: FakeVllm) -> None:
    seen: list[tuple[str | None, str | None]] = []

    class Watcher(Observer):
        def on_response(self, record: ResponseRecord) -> None:
            seen.append((record.length_cause, record.length_cause_source))

    running = await start_proxy(proxy_config(vllm.url, upstream_metrics="vllm", upstream_metrics_interval_s=5.0),
                                extra_observers=(Watcher(),))
    try:
        assert running.check is not None
        while running.check.identity.kind != "vllm":
            await asyncio.sleep(0.01)
        await stream(running, "once", 200)
        await record_for(running, "once")
        assert seen == [("requested_budget", "server_tokenizer")]
    finally:
        await running.close()


async def test_a_server_whose_tokenizer_is_blocked_leaves_the_cause_unknown_and_says_why(
        vllm: FakeVllm, make_proxy: ProxyFactory) -> None:
    vllm.tokenize_status = 404
    running = await asking_proxy(make_proxy, vllm)
    await stream(running, "blocked", 200)
    record = await record_for(running, "blocked")
    assert (record.length_cause, record.length_cause_source) == ("unknown", "counted")
    assert record.length_cause_detail is not None and "404" in record.length_cause_detail
    assert (await samples(running, "llm_proxy_server_tokenizer_requests_total"))[(("result", "unavailable"),)] == 1


async def test_the_flag_turns_the_tokenizer_off(vllm: FakeVllm, make_proxy: ProxyFactory) -> None:
    running = await asking_proxy(make_proxy, vllm, server_tokenizer=False)
    await stream(running, "off", 200)
    record = await record_for(running, "off")
    assert record.length_cause == "unknown" and vllm.tokenize_calls == 0
    assert record.length_cause_detail is not None and "--server-tokenizer off" in record.length_cause_detail


async def test_upstream_metrics_off_asks_the_server_nothing(vllm: FakeVllm, make_proxy: ProxyFactory) -> None:
    running = await make_proxy(vllm.url)  # the tests' default: --upstream-metrics off
    await stream(running, "quiet", 200)
    record = await record_for(running, "quiet")
    assert record.length_cause == "unknown" and vllm.tokenize_calls == 0
    assert running.check is not None and running.check.identity.kind == "unknown"


async def test_a_slow_tokenizer_never_delays_the_clients_bytes(vllm: FakeVllm, make_proxy: ProxyFactory) -> None:
    vllm.tokenize_delay_s = 1.0
    running = await asking_proxy(make_proxy, vllm)
    took = await stream(running, "slow", 50)
    assert took < 0.8  # the answer reached the client; the record waits for the tokenizer
    record = await record_for(running, "slow")
    assert record.length_cause == "requested_budget"


async def test_the_clients_own_credential_goes_with_its_prompt_to_the_tokenizer(
        vllm: FakeVllm, make_proxy: ProxyFactory) -> None:
    """A vLLM started with --api-key asks for one on /tokenize too: the proxy asks with the key of the
    client whose prompt it is, and never keeps it in the record."""
    running = await asking_proxy(make_proxy, vllm)
    await stream(running, "keyed", 200)
    record = await record_for(running, "keyed")
    assert vllm.tokenize_headers[-1].get("Authorization") == "Bearer sk-client"
    assert "sk-client" not in orjson.dumps(record.to_dict()).decode()


async def test_under_load_the_tokenizer_sees_at_most_the_bounded_calls_at_once(
        vllm: FakeVllm, make_proxy: ProxyFactory) -> None:
    vllm.tokenize_delay_s = 0.05
    running = await asking_proxy(make_proxy, vllm)
    await asyncio.gather(*(stream(running, f"load-{i}", 40) for i in range(12)))
    records = [await record_for(running, f"load-{i}") for i in range(12)]
    assert all(r.length_cause == "requested_budget" for r in records)
    assert vllm.tokenize_calls == 12 and vllm.tokenize_peak <= QueueLimits().in_flight


# --- the check on its own -------------------------------------------------------------------------------

class Tokenizer:
    """Answers after `delay` seconds; counts how many it was asked at once."""

    def __init__(self, delay: float = 0.0, fail: str | None = None) -> None:
        self.delay, self.fail = delay, fail
        self.calls = self.running = self.peak = 0
        self.started: list[float] = []

    async def count(self, query: TokenizerQuery, identity: ServerIdentity,
                    authorization: str | None = None) -> PromptCount:
        self.calls += 1
        self.started.append(time.monotonic())
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(self.delay)
            if self.fail:
                raise TokenizerUnavailable(self.fail)
            return PromptCount(10, 512, "test tokenizer")
        finally:
            self.running -= 1


class KnownServer(IdentityPoller):
    def __init__(self) -> None:
        self.enabled = False
        self.identity = ServerIdentity("vllm", None, {"m": ServerInfo("vLLM GET /v1/models", 512)})

    def saw_model(self, model: str | None) -> None:
        pass


def pending(i: int, body_size: int = 10) -> tuple[ResponseRecord, TokenizerQuery]:
    record = ResponseRecord(request_id=f"r{i}", method="POST", path="/v1/chat/completions",
                            route="/v1/chat/completions", dialect="openai", started_at=0.0, model="m", status=200,
                            stop_reason="length", length_cause="unknown", length_cause_source="counted",
                            output_tokens=30, tokens_source="counted", requested_max_tokens=40)
    query = TokenizerQuery("openai", "/v1/chat/completions", "m", b"x" * body_size, 40, None)
    return record, query


async def test_a_full_queue_hands_records_on_at_once_undecided() -> None:
    delivered: list[ResponseRecord] = []
    results: list[str] = []
    tokenizer = Tokenizer(delay=0.2)
    check = ServerCheck(KnownServer(), tokenizer, delivered.append,  # type: ignore[arg-type]
                        QueueLimits(queue_max=2, in_flight=1), on_result=results.append)
    check.start()
    for i in range(5):
        check.finished(*pending(i))
    assert [r.request_id for r in delivered] == ["r2", "r3", "r4"]  # the queue held two: the rest at once
    assert all(r.length_cause == "unknown" and "too many records" in (r.length_cause_detail or "")
               for r in delivered)
    await check.close(timeout_s=2.0)
    assert sorted(r.request_id for r in delivered) == [f"r{i}" for i in range(5)]
    assert results.count("dropped") == 3 and results.count("decided") == 2


async def test_queued_bodies_are_bounded_in_bytes_too() -> None:
    delivered: list[ResponseRecord] = []
    check = ServerCheck(KnownServer(), Tokenizer(delay=0.2), delivered.append,  # type: ignore[arg-type]
                        QueueLimits(queue_bytes=25, in_flight=1))
    check.start()
    for i in range(3):
        check.finished(*pending(i, body_size=10))
    assert [r.request_id for r in delivered] == ["r2"]
    await check.close()


async def test_at_most_in_flight_calls_and_at_most_the_rate_with_no_burst_at_the_start() -> None:
    """The docs' caps: 2 calls at once, 20 a second, and no more in any second, the first included (a
    bucket that started full let 40 through in one)."""
    tokenizer = Tokenizer(delay=0.05)
    delivered: list[ResponseRecord] = []
    check = ServerCheck(KnownServer(), tokenizer, delivered.append,  # type: ignore[arg-type]
                        QueueLimits(in_flight=2, rate_per_s=20.0))
    check.start()
    started = time.monotonic()
    for i in range(30):
        check.finished(*pending(i))
    while len(delivered) < 30:
        await asyncio.sleep(0.01)
    await check.close()
    assert tokenizer.peak == 2
    starts = [t - started for t in tokenizer.started]
    assert max(sum(1 for t in starts if at <= t < at + 1.0) for at in starts) <= 20
    assert all(r.length_cause == "requested_budget" for r in delivered)


async def test_a_tokenizer_that_never_answers_times_out_and_the_record_goes_on() -> None:
    delivered: list[ResponseRecord] = []
    results: list[str] = []
    check = ServerCheck(KnownServer(), Tokenizer(delay=5.0), delivered.append,  # type: ignore[arg-type]
                        QueueLimits(timeout_s=0.1), on_result=results.append)
    check.start()
    check.finished(*pending(0))
    while not delivered:
        await asyncio.sleep(0.01)
    await check.close()
    assert "no answer within 0.1 s" in (delivered[0].length_cause_detail or "") and results == ["timeout"]


async def test_closing_hands_on_every_waiting_record_undecided() -> None:
    delivered: list[ResponseRecord] = []
    check = ServerCheck(KnownServer(), Tokenizer(delay=5.0), delivered.append,  # type: ignore[arg-type]
                        QueueLimits(in_flight=1))
    check.start()
    for i in range(3):
        check.finished(*pending(i))
    await asyncio.sleep(0.05)
    await check.close(timeout_s=0.1)
    assert sorted(r.request_id for r in delivered) == ["r0", "r1", "r2"]
    assert all("stopped before" in (r.length_cause_detail or "") for r in delivered)


async def test_a_record_that_needs_nothing_passes_straight_through() -> None:
    delivered: list[ResponseRecord] = []
    check = ServerCheck(KnownServer(), Tokenizer(), delivered.append)  # type: ignore[arg-type]
    record, _ = pending(0)
    check.finished(record, None)
    assert delivered == [record]


def test_settling_a_record_writes_what_the_tokenizer_said() -> None:
    record, query = pending(0)
    Recorder.settle_length(record, query, "vllm", PromptCount(480, 512, "vLLM POST /tokenize"), None)
    assert (record.length_cause, record.length_cause_source, record.prompt_tokens) == (
        "server_limit", "server_tokenizer", 480)


# --- what server it is -----------------------------------------------------------------------------------

async def serve(routes: dict[str, Any]) -> TestServer:
    app = web.Application()
    for path, answer in routes.items():
        async def handler(request: web.Request, answer: Any = answer) -> web.Response:
            body = answer(request) if callable(answer) else answer
            return web.json_response(body)
        app.router.add_get(path, handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


@pytest.mark.parametrize(("routes", "kind", "context"), [
    ({"/props": {"default_generation_settings": {"n_ctx": 1024}, "total_slots": 4}}, "llamacpp", 1024),
    ({"/v1/models": {"data": [{"id": "m", "owned_by": "vllm", "max_model_len": 4096}]}}, "vllm", 4096),
    ({"/v1/models": {"data": [{"id": "m", "owned_by": "sglang", "max_model_len": 8192}]}}, "sglang", 8192),
    ({"/api/version": {"version": "0.33.2"},
      "/api/ps": {"models": [{"name": "m", "model": "m", "context_length": 2048}]}}, "ollama", 2048),
    ({"/v1/models": {"data": [{"id": "m", "owned_by": "library"}]}}, "unknown", None),
])
async def test_what_server_it_is_and_the_context_it_gives(routes: dict[str, Any], kind: str,
                                                         context: int | None) -> None:
    server = await serve(routes)
    try:
        async with aiohttp.ClientSession() as session:
            facts = await read_identity(session, str(server.make_url("")).rstrip("/"), ("m",))
    finally:
        await server.close()
    info = facts.info_for("m")
    assert facts.kind == kind and (info.context_per_request if info else None) == context


async def test_a_llamacpp_router_is_asked_per_model_and_never_made_to_load_one() -> None:
    asked: list[str] = []

    def props(request: web.Request) -> dict[str, Any]:
        asked.append(request.query_string)
        if "model" not in request.query:
            return {"role": "router", "default_generation_settings": {"n_ctx": 0}}
        return {"default_generation_settings": {"n_ctx": 2048}, "total_slots": 2}

    server = await serve({"/props": props, "/v1/models": {"data": [
        {"id": "a.gguf", "owned_by": "llamacpp", "status": {"value": "loaded"}},
        {"id": "b.gguf", "owned_by": "llamacpp", "status": {"value": "unloaded"}}]}})
    try:
        async with aiohttp.ClientSession() as session:
            facts = await read_identity(session, str(server.make_url("")).rstrip("/"))
    finally:
        await server.close()
    assert facts.router and facts.kind == "llamacpp"
    assert facts.info_for("a.gguf") == ServerInfo("llama.cpp GET /props", 2048, 2)
    assert facts.info_for("b.gguf") is None and asked == ["", "model=a.gguf&autoload=false"]


async def test_what_was_known_survives_a_server_that_stops_answering() -> None:
    server = await serve({"/v1/models": {"data": [{"id": "m", "owned_by": "vllm", "max_model_len": 512}]}})
    base = str(server.make_url("")).rstrip("/")
    async with aiohttp.ClientSession() as session:
        poller = IdentityPoller(session, base)
        assert (await poller.ask()).kind == "vllm"
        await server.close()
        assert (await poller.ask()).kind == "unknown"
        assert poller.identity.kind == "vllm"


async def test_a_connection_the_server_closed_under_a_count_is_tried_once_more() -> None:
    """Counting has no side effect: unlike a client's POST, it may go again on another connection."""
    calls = 0

    async def tokenize(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        if calls == 1:
            assert request.transport is not None
            request.transport.close()  # gone before any answer, as a keep-alive timer does it
            return web.Response()
        return web.json_response({"count": 9, "max_model_len": 512, "tokens": list(range(9))})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            tokenizer = ServerTokenizer(session, str(server.make_url("")).rstrip("/"))
            query = TokenizerQuery("openai", "/v1/chat/completions", "m", orjson.dumps({"messages": PROMPT}), 40, None)
            count = await tokenizer.count(query, KnownServer().identity)
    finally:
        await server.close()
    assert (count.tokens, count.context, calls) == (9, 512, 2)


async def test_with_workers_each_asks_the_tokenizer_and_the_supervisor_counts_it(
        vllm: FakeVllm, tmp_path: Any) -> None:
    from tests.support.proxies import start_served

    served = await start_served(vllm.url, tmp_path, "--upstream-metrics", "vllm", workers=2)
    try:
        await asyncio.sleep(1.0)  # each worker has identified the server
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            async def one(i: int) -> None:
                body = {"model": MODEL, "messages": PROMPT, "max_tokens": 60, "stream": True}
                async with session.post(served.proxy_url + "/v1/chat/completions", json=body,
                                        headers={"X-Request-Id": f"wk-{i}"}) as response:
                    await response.read()

            await asyncio.gather(*(one(i) for i in range(6)))
            for _ in range(300):
                async with session.get(served.admin_url + "/api/requests?limit=50") as response:
                    listed = orjson.loads(await response.read())["records"]
                if len(listed) == 6:
                    break
                await asyncio.sleep(0.02)
            async with session.get(served.admin_url + "/metrics") as response:
                text = await response.text()
        assert sorted(r["length_cause_source"] for r in listed) == ["server_tokenizer"] * 6
        assert 'llm_proxy_server_tokenizer_requests_total{result="decided"} 6.0' in text
    finally:
        served.stop()
