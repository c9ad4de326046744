"""OpenTelemetry spans with the real SDK's OTLP/HTTP exporter, received by an OTLP endpoint here that
decodes the protobuf: one GenAI-conventions span per response, in the client's trace when it sent
a traceparent, and an endpoint that is down costs spans, counted, never traffic."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.serve.app import RunningProxy
from tests.support.proxies import ProxyFactory
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.wire import openai_stream

trace_service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2",
                                    reason="pip install 'llm-diag-proxy[otel]'")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
CHAT = {"model": "m", "stream": True, "max_tokens": 100, "temperature": 0.5,
        "messages": [{"role": "user", "content": "a secret prompt"}]}


class OtlpReceiver:
    """POST /v1/traces: ExportTraceServiceRequest protobufs, kept decoded."""

    def __init__(self) -> None:
        self.spans: list[object] = []
        self.server: TestServer | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return str(self.server.make_url("")).rstrip("/")

    async def _traces(self, request: web.Request) -> web.Response:
        message = trace_service.ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        for resource in message.resource_spans:
            for scope in resource.scope_spans:
                self.spans.extend(scope.spans)
        return web.Response(body=trace_service.ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    found = OtlpReceiver()
    await found.start()
    yield found
    assert found.server is not None
    await found.server.close()


def attributes(span: object) -> dict[str, object]:
    out: dict[str, object] = {}
    for kv in span.attributes:  # type: ignore[attr-defined]
        value = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = ([v.string_value for v in value.array_value.values] if kind == "array_value"
                       else getattr(value, kind))
    return out


async def send(proxy: RunningProxy, headers: dict[str, str]) -> None:
    async with aiohttp.ClientSession() as client, client.post(
            proxy.proxy_url + "/v1/chat/completions", json=CHAT, headers=headers) as response:
        await response.read()


async def test_one_genai_span_per_response_in_the_clients_trace(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory, receiver: OtlpReceiver,
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert receiver.server is not None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", str(receiver.server.make_url("")).rstrip("/"))
    monkeypatch.setenv("OTEL_SERVICE_NAME", "proxy-under-test")
    upstream.default = Script(chunks=openai_stream(6, "length"), delay=0.01)
    proxy = await make_proxy(upstream.url, otel=True)
    await send(proxy, {"traceparent": f"00-{TRACE_ID}-{PARENT}-01", "X-Request-Id": "traced"})
    await send(proxy, {"X-Request-Id": "untraced"})
    deadline = time.monotonic() + 20
    while len(receiver.spans) < 2:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    by_id = {attributes(s)["llm_diag.request_id"]: s for s in receiver.spans}
    traced, untraced = by_id["traced"], by_id["untraced"]
    assert traced.trace_id.hex() == TRACE_ID and traced.parent_span_id.hex() == PARENT  # type: ignore[attr-defined]
    assert untraced.trace_id.hex() != TRACE_ID and not untraced.parent_span_id  # type: ignore[attr-defined]
    assert traced.name == "chat m" and traced.kind == 3  # type: ignore[attr-defined]  # SPAN_KIND_CLIENT
    found = attributes(traced)
    port = int(upstream.url.rsplit(":", 1)[1])
    assert {k: found[k] for k in ("gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model",
                                  "gen_ai.request.max_tokens", "gen_ai.response.finish_reasons",
                                  "gen_ai.usage.output_tokens", "server.address", "server.port")} == {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai", "gen_ai.request.model": "m",
        "gen_ai.request.max_tokens": 100, "gen_ai.response.finish_reasons": ["length"],
        "gen_ai.usage.output_tokens": 6, "server.address": "127.0.0.1", "server.port": port}
    assert found["gen_ai.request.temperature"] == 0.5 and found["gen_ai.usage.input_tokens"] == 7
    assert found["llm_diag.stop_reason"] == "length" and found["llm_diag.cause"] == "server_limit"
    assert found["llm_diag.outcome"] == "cut" and found["llm_diag.concurrency_peak"] == 1
    assert [e.name for e in traced.events] == ["gen_ai.first_token"]  # type: ignore[attr-defined]
    assert traced.end_time_unix_nano > traced.events[0].time_unix_nano > traced.start_time_unix_nano  # type: ignore[attr-defined]
    assert "a secret prompt" not in repr(receiver.spans)  # no prompt, no completion
    # The client's traceparent reached the upstream unchanged, so the server's own spans join the trace.
    assert upstream.seen[0].headers["traceparent"] == f"00-{TRACE_ID}-{PARENT}-01"


async def test_an_endpoint_that_is_down_costs_counted_spans_never_traffic(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    upstream.default = Script(chunks=openai_stream(3))
    proxy = await make_proxy(upstream.url, otel=True)
    started = time.monotonic()
    for n in range(3):
        await send(proxy, {"X-Request-Id": f"d{n}"})
    assert time.monotonic() - started < 5  # the exporter's retries never reach the traffic
    deadline = time.monotonic() + 40
    while True:
        async with aiohttp.ClientSession() as client, client.get(proxy.admin_url + "/metrics") as response:
            text = await response.text()
        if "llm_proxy_trace_spans_dropped_total 3.0" in text:
            break
        assert time.monotonic() < deadline, [line for line in text.splitlines() if "trace" in line]
        await asyncio.sleep(0.5)
