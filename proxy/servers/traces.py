"""A server's own account of each request, as it exports it: OTLP/HTTP trace bodies in, `ServerSpan`s out.
Which spans are a server's request spans, and what their attributes mean, its module says
(`SpanNames`); what follows is vLLM's, the one server that exports them today.

vLLM, started with `--otlp-traces-endpoint` (and `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf`),
exports one `llm_request` span per request that finishes (vllm/v1/engine/output_processor.py,
do_tracing; attribute names in vllm/tracing/utils.py, SpanAttributes):
- `gen_ai.request.id`: its request id, `chatcmpl-<X-Request-Id>` or `cmpl-<X-Request-Id>`
  (vllm/entrypoints/serve/engine/serving.py, _base_request_id), so the id the proxy sends upstream;
- `gen_ai.usage.prompt_tokens`, `gen_ai.usage.completion_tokens` (its `num_generation_tokens`),
  `gen_ai.request.max_tokens` (the client's, where it gave one);
- `gen_ai.latency.time_in_queue`, `time_to_first_token`, `e2e`, `time_in_model_prefill`,
  `time_in_model_decode` (seconds);
- the client's trace id where the request carried a `traceparent`, and its start as the span's start.

A request vLLM aborts (its client left) gets no span: the abort path frees it without tracing
(`OutputProcessor.abort_requests`). The body is decoded with `opentelemetry-proto`, as protobuf
(`application/x-protobuf`) or as OTLP JSON (`application/json`: lowerCamelCase names, ids in hex).
Only spans named as a server's request span are read; the rest are counted and left.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.servers import vllm
from proxy.servers.base import SpanNames

# The request spans a server exports, by name, and what each attribute is (a server's module says).
REQUEST_SPANS: dict[str, SpanNames] = {vllm.SPAN_NAMES.span: vllm.SPAN_NAMES}
REQUEST_SPAN_NAMES = frozenset(REQUEST_SPANS)
MAX_ID = 256  # characters of a request id taken from a span
MAX_COUNT = 1 << 40
MAX_SECONDS = 7 * 86400.0


class NotTraces(ValueError):
    """A body that is not an OTLP trace export."""


@dataclass(frozen=True, slots=True)
class ServerSpan:
    """One request as the server itself accounts for it; None where its span does not say."""

    request_id: str | None  # the id the proxy sent upstream, its server prefix taken off
    trace_id: str | None  # 32 hex
    start_unix_s: float  # when the server took the request (its arrival)
    end_unix_s: float  # when it finished it
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    max_tokens: int | None = None
    n: int | None = None
    queue_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None

    @property
    def keys(self) -> tuple[str, ...]:
        """What a record is found by: its request id, else its trace id."""
        return tuple(key for key in (self.request_id and "id:" + self.request_id,
                                     self.trace_id and "trace:" + self.trace_id) if key)


def request_id_of(value: str, names: SpanNames) -> str:
    for prefix in names.id_prefixes:
        if value.startswith(prefix):
            return value[len(prefix):]
    return value


def _count(value: Any) -> int | None:
    if isinstance(value, str) and value.isdigit():  # OTLP JSON writes an int64 as a string
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_COUNT:
        return value
    return None


def _nanoseconds(value: Any) -> int:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63 else 0


def _seconds(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) \
            and 0 <= value < MAX_SECONDS:
        return float(value)
    return None


def span_of(name: str, trace_id: str, start_ns: int, end_ns: int, attributes: dict[str, Any]) -> ServerSpan | None:
    """A server's request span from its parts; None for any other span."""
    names = REQUEST_SPANS.get(name)
    if names is None:
        return None
    raw_id = attributes.get(names.request_id)
    request_id = request_id_of(raw_id, names)[:MAX_ID] if isinstance(raw_id, str) and raw_id else None
    trace = trace_id.lower() if len(trace_id) == 32 and trace_id.strip("0") else None
    counts = {field: _count(attributes.get(key)) for key, field in names.counts.items()}
    seconds = {field: _seconds(attributes.get(key)) for key, field in names.seconds.items()}
    if request_id is None and trace is None:
        return None
    values: dict[str, Any] = {**counts, **seconds}
    return ServerSpan(request_id, trace, start_ns / 1e9, max(end_ns, start_ns) / 1e9, **values)


def decode(body: bytes, content_type: str) -> tuple[list[ServerSpan], int]:
    """The request spans in one OTLP/HTTP export and how many other spans it held; NotTraces when the
    body is not one."""
    if content_type.split(";")[0].strip().lower() == "application/json":
        return _from_json(body)
    return _from_protobuf(body)


def _from_protobuf(body: bytes) -> tuple[list[ServerSpan], int]:
    from google.protobuf.message import DecodeError  # type: ignore[import-untyped]
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    export = ExportTraceServiceRequest()
    try:
        export.ParseFromString(body)
    except DecodeError as exc:
        raise NotTraces(f"not an OTLP protobuf trace export: {exc}"[:200]) from None
    found, other = [], 0
    for resource in export.resource_spans:
        for scope in resource.scope_spans:
            for span in scope.spans:
                if span.name not in REQUEST_SPAN_NAMES:
                    other += 1
                    continue
                attributes = {a.key: _any_value(a.value) for a in span.attributes}
                read = span_of(span.name, span.trace_id.hex(), span.start_time_unix_nano, span.end_time_unix_nano,
                               attributes)
                if read is None:
                    other += 1
                else:
                    found.append(read)
    return found, other


def _any_value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def _from_json(body: bytes) -> tuple[list[ServerSpan], int]:
    try:
        export = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise NotTraces("not JSON") from None
    if not isinstance(export, dict) or not isinstance(export.get("resourceSpans", []), list):
        raise NotTraces("no resourceSpans list")
    found, other = [], 0
    for span in _json_spans(export.get("resourceSpans", [])):
        name = span.get("name")
        if name not in REQUEST_SPAN_NAMES:
            other += 1
            continue
        attributes = {str(a.get("key")): _json_value(a.get("value")) for a in span.get("attributes", ())
                      if isinstance(a, dict)}
        trace_id = span.get("traceId")
        read = span_of(str(name), trace_id if isinstance(trace_id, str) else "",
                       _nanoseconds(span.get("startTimeUnixNano")), _nanoseconds(span.get("endTimeUnixNano")),
                       attributes)
        if read is None:
            other += 1
        else:
            found.append(read)
    return found, other


def _json_spans(resources: Iterable[Any]) -> Iterable[dict[str, Any]]:
    for resource in resources:
        scopes = resource.get("scopeSpans") if isinstance(resource, dict) else None
        for scope in scopes if isinstance(scopes, list) else ():
            spans = scope.get("spans") if isinstance(scope, dict) else None
            yield from (span for span in (spans if isinstance(spans, list) else ()) if isinstance(span, dict))


def _json_value(value: Any) -> Any:
    if not isinstance(value, dict):
        return None
    for key in ("stringValue", "intValue", "doubleValue", "boolValue"):
        if key in value:
            return value[key]
    return None
