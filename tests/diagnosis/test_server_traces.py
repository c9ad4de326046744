"""The join of records and the server's spans: bounded, once, and a span that comes late updates nothing."""

from __future__ import annotations

import asyncio
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from proxy.diagnosis.server_traces import TraceJoin, TraceLimits
from proxy.record import ResponseRecord
from proxy.servers.traces import ServerSpan, decode


def record(rid: str, **fields: Any) -> ResponseRecord:
    base: dict[str, Any] = {"method": "POST", "path": "/v1/chat/completions", "route": "/v1/chat/completions",
                            "dialect": "openai", "started_at": 1796000000.0, "status": 200, "stop_reason": "length",
                            "requested_max_tokens": 20, "output_tokens": 14, "tokens_source": "counted",
                            "length_cause_source": "counted", "length_cause": "unknown"}
    return ResponseRecord(request_id=rid, **{**base, **fields})


def span(rid: str, completion: int = 20, **fields: Any) -> ServerSpan:
    return ServerSpan(rid, None, 1796000000.0, 1796000001.0, prompt_tokens=9, completion_tokens=completion,
                      **fields)


def test_vllms_span_through_the_real_sdk_and_its_encoder_decodes() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.get_tracer("vllm").start_span("llm_request", kind=SpanKind.SERVER, start_time=1796000000_000000000,
                                           attributes={"gen_ai.request.id": "chatcmpl-abc",
                                                       "gen_ai.usage.completion_tokens": 20,
                                                       "gen_ai.usage.prompt_tokens": 9,
                                                       "gen_ai.latency.time_in_queue": 0.25,
                                                       "gen_ai.request.max_tokens": 20}).end()
    provider.get_tracer("other").start_span("GET /health").end()
    body = encode_spans(exporter.get_finished_spans()).SerializeToString()
    spans, other = decode(body, "application/x-protobuf")
    assert other == 1 and len(spans) == 1
    found = spans[0]
    assert (found.request_id, found.completion_tokens, found.prompt_tokens, found.max_tokens, found.queue_s) == (
        "abc", 20, 9, 20, 0.25)
    assert found.start_unix_s == 1796000000.0 and found.trace_id is not None


async def test_a_waiting_record_joins_its_span_and_a_late_one_changes_nothing() -> None:
    went: list[tuple[ResponseRecord, Any]] = []
    counted: list[str] = []
    join = TraceJoin(lambda r, q, a: went.append((r, q)), TraceLimits(wait_s=0.05),
                     lambda result, n: counted.extend([result] * n))
    join.receive([span("warm")])  # the server sends spans: records wait for theirs
    first, second = record("a"), record("b")
    join.finished(first, None, None, 14)
    join.finished(second, None, None, 14)
    assert join.waiting == 2 and not went
    join.receive([span("a", completion=20)])
    assert went[0][0] is first and (first.length_cause, first.length_cause_source) == (
        "requested_budget", "server_trace")
    await asyncio.sleep(0.1)  # b's span never came
    assert went[1][0] is second and second.server_trace == "missing" and join.waiting == 0
    join.receive([span("b")])
    assert counted.count("late") == 1 and second.length_cause == "unknown"
    assert counted.count("joined") == 1


async def test_everything_held_is_bounded() -> None:
    went: list[ResponseRecord] = []
    counted: list[str] = []
    join = TraceJoin(lambda r, q, a: went.append(r), TraceLimits(wait_s=5, max_waiting=2, max_spans=3),
                     lambda result, n: counted.extend([result] * n))
    join.receive([span("warm")])
    for name in "abc":
        join.finished(record(name), None, None, None)
    assert join.waiting == 2 and [r.request_id for r in went] == ["c"]  # past the bound: on at once
    join.receive([span(f"nobody-{i}") for i in range(5)])
    assert counted.count("unmatched") >= 2  # the oldest spans make room
    join.close()
    assert {r.request_id for r in went} == {"a", "b", "c"} and join.waiting == 0


async def test_a_span_that_came_first_waits_for_its_record() -> None:
    went: list[ResponseRecord] = []
    join = TraceJoin(lambda r, q, a: went.append(r), TraceLimits(wait_s=5))
    join.receive([span("early", completion=12)])
    early = record("early")
    join.finished(early, None, None, 12)
    assert went == [early] and (early.length_cause, early.server_trace) == ("server_limit", "joined")


def test_the_live_verdict_names_the_switches_for_exact_counts() -> None:
    from proxy.sweep.live import exact_truth_lines

    def stop(rid: str, cause: str, source: str | None) -> ResponseRecord:
        return record(rid, upstream="http://vllm:8000", length_cause=cause, length_cause_source=source)

    (line,) = exact_truth_lines([stop("a", "requested_budget", "server_tokenizer"), stop("b", "unknown", "counted"),
                                 stop("c", "requested_budget", "server_trace"), stop("d", "server_limit", "usage")])
    assert line.startswith("http://vllm:8000: of 4 length stops, 1 settled by inference (the server's tokenizer) "
                           "and 1 left unknown")
    assert "--server-traces on" in line and "--otlp-traces-endpoint" in line and "--enable-force-include-usage" in line
    assert exact_truth_lines([stop("e", "requested_budget", "server_trace")]) == []


def test_the_live_verdict_says_what_the_gate_did() -> None:
    from proxy.sweep.live import gate_lines

    before = [record(f"b{i}", started_at=1.0, stop_reason="length", length_cause="server_limit",
                     length_cause_source="output_count") for i in range(4)]
    after = [record(f"a{i}", started_at=10.0 + i, stop_reason="eos", queue_time_s=0.5 * i,
                    queue_time_source="proxy") for i in range(5)]
    (line,) = gate_lines([*before, *after])
    assert line.startswith("the proxy's admission gate: since it first held an answer, 5 of 5 answers complete "
                           "(100%), against 0% before; p95 wait at the gate 2.00 s")
    assert gate_lines(before) == []


async def test_spans_of_requests_the_proxy_never_saw_are_counted_once_their_hold_ends() -> None:
    now = [0.0]
    counted: list[str] = []
    join = TraceJoin(lambda r, q, a: None, TraceLimits(span_hold_s=30), lambda result, n: counted.extend([result] * n),
                     clock=lambda: now[0])
    join.receive([span("nobody-1"), span("nobody-2")])
    assert counted == []
    now[0] = 31.0
    join.receive([])  # (each receipt lets the old ones go)
    assert counted == ["unmatched", "unmatched"]


async def test_a_flood_of_spans_is_cut_to_the_rate_and_the_exporter_told() -> None:
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    from proxy.serve.trace_receiver import TraceReceiver

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    for n in range(50):
        provider.get_tracer("vllm").start_span("llm_request", attributes={"gen_ai.request.id": f"chatcmpl-{n}",
                                                                          "gen_ai.usage.completion_tokens": 3}).end()
    body = encode_spans(exporter.get_finished_spans()).SerializeToString()
    taken: list[ServerSpan] = []
    counted: list[str] = []
    receiver = TraceReceiver(taken.extend, lambda result, n: counted.extend([result] * n), spans_per_s=10,
                             clock=lambda: 0.0)
    app = web.Application()
    app.router.add_post("/v1/traces", receiver.handle)
    async with TestClient(TestServer(app)) as client:
        response = await client.post("/v1/traces", data=body, headers={"Content-Type": "application/x-protobuf"})
        assert response.status == 200
        answer = ExportTraceServiceResponse.FromString(await response.read())
    assert len(taken) == 10 and counted.count("dropped") == 40
    assert answer.partial_success.rejected_spans == 40
