"""OpenTelemetry traces: one span per response, in the GenAI semantic conventions, over OTLP.

An observer like the others, off by default (`--otel`). `on_response` puts the record on a bounded
queue and returns; a thread of its own turns records into spans (their start and end are the
record's own times, so the span says when the answer ran, not when it was exported) and sends
them in batches with the OpenTelemetry SDK's OTLP exporter. A full queue drops the record's span
and counts it (`llm_proxy_trace_spans_dropped_total`); an exporter that fails is logged once per
failure streak and counted; the traffic never waits.

Each span carries:
- the GenAI conventions: `gen_ai.operation.name`, `gen_ai.provider.name` (the API the dialect
  speaks: openai, anthropic, ollama, llama.cpp), `gen_ai.request.model`, `gen_ai.request.max_tokens`,
  `gen_ai.request.temperature`/`seed`, `gen_ai.response.finish_reasons`, `gen_ai.response.id`,
  `gen_ai.usage.input_tokens`/`output_tokens`/`reasoning.output_tokens`, `server.address`/`server.port`;
- the proxy's own figures under `llm_diag.*` (stop reason, cause, outcome, length cause,
  concurrency, deadline, disconnect, reasoning share, the server-state and GPU figures);
- an event `gen_ai.first_token` at the first token.

A client that sends a W3C `traceparent` gets the span in its trace, as a child of its own span;
the header itself reaches the upstream unchanged, so vLLM's spans join the same trace. Without
one, the span starts a trace of its own.

The exporter is configured the standard way: `OTEL_EXPORTER_OTLP_ENDPOINT` (or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), `OTEL_EXPORTER_OTLP_PROTOCOL` (`http/protobuf`, or `grpc`
where `opentelemetry-exporter-otlp-proto-grpc` is installed), `OTEL_EXPORTER_OTLP_HEADERS`,
`OTEL_SERVICE_NAME` (default `llm-diag-proxy`). The SDK is an optional extra:
`pip install 'llm-diag-proxy[otel]'`.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import structlog

from proxy.observers.hooks import Observer
from proxy.record import ResponseRecord
from proxy.wire.dialects import provider_of

_log = structlog.get_logger("llm_diag_proxy")
QUEUE_MAX = 10_000
BATCH_MAX = 512
FLUSH_S = 1.0
TEXT_COMPLETION_ROUTES = ("/v1/completions", "/api/generate", "/completion", "/completions")
PROJECT_ATTRIBUTES = (
    "stop_reason", "length_cause", "cause", "outcome", "stop_reason_certain", "deadline_hit", "client_disconnected",
    "disconnect_phase", "upstream_error", "reasoning_share", "tokens_source", "concurrency_at_start",
    "concurrency_peak", "concurrency_mean", "ttft_s", "itl_mean_s", "queue_time_s", "preemptions_during",
    "kv_cache_usage_max", "upstream_running_max", "upstream_waiting_max", "vram_free_min_bytes", "route", "status",
    "request_id",
)


class TracingUnavailable(Exception):
    """The OpenTelemetry SDK or its OTLP exporter is not installed."""


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def operation_of(record: ResponseRecord) -> str:
    return "text_completion" if record.route in TEXT_COMPLETION_ROUTES else "chat"


def attributes_of(record: ResponseRecord, upstream: str) -> dict[str, Any]:
    """The span's attributes (no prompt, no completion, no header value)."""
    where = urlsplit(upstream)
    found: dict[str, Any] = {
        "gen_ai.operation.name": operation_of(record),
        "gen_ai.provider.name": provider_of(record.dialect),
        "server.address": where.hostname or "",
        "server.port": where.port or (443 if where.scheme == "https" else 80),
    }
    pairs = (("gen_ai.request.model", record.model), ("gen_ai.request.max_tokens", record.requested_max_tokens),
             ("gen_ai.request.temperature", record.temperature), ("gen_ai.request.seed", record.seed),
             ("gen_ai.response.id", record.upstream_request_id),
             ("gen_ai.usage.input_tokens", record.prompt_tokens), ("gen_ai.usage.output_tokens", record.output_tokens),
             ("gen_ai.usage.reasoning.output_tokens", record.reasoning_tokens))
    found.update({k: v for k, v in pairs if v is not None})
    if record.finish_reason_raw is not None:
        found["gen_ai.response.finish_reasons"] = [record.finish_reason_raw]
    body = record.to_dict()
    for name in PROJECT_ATTRIBUTES:
        value = body.get(name)
        if value is not None:
            found[f"llm_diag.{name}"] = value
    return found


class Tracer(Observer):
    """The observer: records in, spans out, on a thread of its own."""

    def __init__(self, upstream: str, metrics: Any = None, *, exporter: Any = None) -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
        except ImportError as exc:
            raise TracingUnavailable("OpenTelemetry is not installed: pip install 'llm-diag-proxy[otel]'") from exc
        self._upstream = upstream
        self._metrics = metrics
        self._trace = trace
        self._exporter = exporter if exporter is not None else _exporter()
        self._ended: list[ReadableSpan] = []
        ended = self._ended

        class Collect(SpanProcessor):
            def on_end(self, span: ReadableSpan) -> None:
                ended.append(span)

        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or "llm-diag-proxy"})
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(Collect())
        self._provider = provider
        self._tracer = provider.get_tracer("llm-diag-proxy")
        self._queue: queue.Queue[ResponseRecord | None] = queue.Queue(QUEUE_MAX)
        self._failing = False
        self.exported = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="llm-diag-tracing", daemon=True)
        self._thread.start()

    def on_response(self, record: ResponseRecord) -> None:
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self._drop(1)

    def close(self, timeout_s: float = 5.0) -> None:
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self._thread.join(timeout_s)
        self._exporter.shutdown()

    def _drop(self, count: int) -> None:
        self.dropped += count
        if self._metrics is not None:
            self._metrics.trace_spans_dropped.inc(count)

    def _run(self) -> None:
        stopping = False
        while not stopping:
            try:
                item = self._queue.get(timeout=FLUSH_S)
            except queue.Empty:
                continue
            deadline = time.monotonic() + FLUSH_S
            while True:
                if item is None:
                    stopping = True
                    break
                self._span(item)
                if len(self._ended) >= BATCH_MAX:
                    break
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
            self._export()

    def _span(self, record: ResponseRecord) -> None:
        trace = self._trace
        context = None
        if record.trace_id and record.parent_span_id:
            parent = trace.SpanContext(int(record.trace_id, 16), int(record.parent_span_id, 16), is_remote=True,
                                       trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))
            context = trace.set_span_in_context(trace.NonRecordingSpan(parent))
        start = _ns(record.started_at)
        name = f"{operation_of(record)} {record.model}" if record.model else operation_of(record)
        span = self._tracer.start_span(name, context=context, kind=trace.SpanKind.CLIENT, start_time=start,
                                       attributes=attributes_of(record, self._upstream))
        if record.ttft_s is not None:
            span.add_event("gen_ai.first_token", timestamp=start + _ns(record.ttft_s))
        if record.outcome in ("cut", "failed"):
            span.set_status(trace.Status(trace.StatusCode.ERROR, f"{record.stop_reason}: {record.cause}"))
        span.end(end_time=start + _ns(record.duration_s))

    def _export(self) -> None:
        if not self._ended:
            return
        batch = self._ended[:]
        self._ended.clear()
        try:
            from opentelemetry.sdk.trace.export import SpanExportResult

            ok = self._exporter.export(batch) == SpanExportResult.SUCCESS
        except Exception as exc:  # an exporter must never take the thread down
            ok = False
            error = repr(exc)[:300]
        else:
            error = "the exporter reported a failure"
        if ok:
            self.exported += len(batch)
            if self._failing:
                _log.info("trace_export_recovered")
            self._failing = False
            return
        self._drop(len(batch))
        if not self._failing:
            _log.error("trace_export_failed", error=error, spans=len(batch),
                       note="spans are dropped until the endpoint answers; the proxy keeps serving")
        self._failing = True


def _exporter() -> Any:
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf")
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter,
            )
        except ImportError as exc:
            raise TracingUnavailable("OTLP over gRPC needs opentelemetry-exporter-otlp-proto-grpc") from exc
        return OTLPSpanExporter()
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
    except ImportError as exc:
        raise TracingUnavailable("OpenTelemetry's OTLP exporter is not installed: "
                                 "pip install 'llm-diag-proxy[otel]'") from exc
    return HttpExporter()
