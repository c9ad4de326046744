"""`POST /v1/traces` on the admin listener (`serve --server-traces on`): an OTLP/HTTP trace receiver for
the server's own request spans, as a server's exporter sends them (`--otlp-traces-endpoint
http://PROXY_ADMIN/v1/traces`, protocol `http/protobuf`; OTLP JSON is taken too).

Bounded: a body past `max_body` bytes is refused (413) unread; past `spans_per_s` (a token bucket
with a second's burst) spans are dropped and counted, and the answer says how many were rejected
(OTLP's partial success), so that the exporter does not send them again. The spans go to `sink`: the
one serving process's join, or every worker's. The admin token guards it like the admin API.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import orjson
from aiohttp import web

from proxy.servers.traces import NotTraces, ServerSpan, decode

MAX_BODY = 4 * 1024 * 1024
CONTENT_TYPES = frozenset({"application/x-protobuf", "application/protobuf", "application/json"})
SPANS_PER_S = 2000.0


class TraceReceiver:
    def __init__(self, sink: Callable[[list[ServerSpan]], None], count: Callable[[str, int], None],
                 max_body: int = MAX_BODY, spans_per_s: float = SPANS_PER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._sink = sink
        self._count = count
        self.max_body = max_body
        self.spans_per_s = spans_per_s
        self._clock = clock
        self._tokens = spans_per_s
        self._filled_at = clock()

    def _allow(self, wanted: int) -> int:
        now = self._clock()
        self._tokens = min(self.spans_per_s, self._tokens + (now - self._filled_at) * self.spans_per_s)
        self._filled_at = now
        allowed = min(wanted, int(self._tokens))
        self._tokens -= allowed
        return allowed

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.content_type not in CONTENT_TYPES:
            # (Only types a browser cannot send across origins without asking first: no web page can
            # post spans into the records.)
            return _refused(415, "unsupported_media_type", "an OTLP/HTTP trace export is application/x-protobuf "
                                                           "or application/json")
        json_body = request.content_type == "application/json"
        if request.content_length is not None and request.content_length > self.max_body:
            return _refused(413, "too_large", f"a trace export of at most {self.max_body} bytes is read")
        body = bytearray()
        async for chunk in request.content.iter_any():
            body += chunk
            if len(body) > self.max_body:
                return _refused(413, "too_large", f"a trace export of at most {self.max_body} bytes is read")
        try:
            spans, other = decode(bytes(body), request.content_type)
        except NotTraces as exc:
            return _refused(400, "not_traces", str(exc))
        if other:
            self._count("not_request", other)
        allowed = self._allow(len(spans))
        rejected = len(spans) - allowed
        if rejected:
            self._count("dropped", rejected)
        if allowed:
            self._sink(spans[:allowed])
        return _accepted(json_body, rejected)


def _refused(status: int, code: str, message: str) -> web.Response:
    return web.Response(status=status, body=orjson.dumps({"error": {"code": code, "message": message}}),
                        content_type="application/json")


def _accepted(json_body: bool, rejected: int) -> web.Response:
    """OTLP's ExportTraceServiceResponse, with its partial success where spans were dropped."""
    message = f"{rejected} spans over the receiver's rate, dropped" if rejected else ""
    if json_body:
        answer = {"partialSuccess": {"rejectedSpans": str(rejected), "errorMessage": message}} if rejected else {}
        return web.Response(body=orjson.dumps(answer), content_type="application/json")
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    response = ExportTraceServiceResponse()
    if rejected:
        response.partial_success.rejected_spans = rejected
        response.partial_success.error_message = message
    return web.Response(body=response.SerializeToString(), content_type="application/x-protobuf")


async def receiver_off(request: web.Request) -> web.Response:
    return _refused(404, "not_found", "the proxy takes no server traces: start it with --server-traces on")
