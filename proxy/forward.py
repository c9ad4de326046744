"""The forwarding path: every request to the upstream and every byte back, unchanged and at once.

It knows nothing of metrics, logs or NVML. It watches the bytes go by (a parser reads a copy
of each chunk after it was written to the client), and hands one record per response to the
observers. Where the diagnosis fails, the traffic does not: the record says `parse_error`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import time
import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from proxy.classify import WireFacts, classify
from proxy.concurrency import InFlightTracker, Slot
from proxy.config import ProxyConfig
from proxy.dialects import parse_request
from proxy.observation import StreamObservation
from proxy.observers import ObserverChain
from proxy.parsers import parser_for
from proxy.record import RequestInfo, ResponseRecord, UpstreamErrorKind
from proxy.routes import OTHER_ROUTE, route_of

REQUEST_ID = "X-Request-Id"
CONCURRENCY = "X-LLM-Diag-Concurrency"
# RFC 9110 section 7.6.1 hop-by-hop fields, plus the ones aiohttp computes itself.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
})
_REQUEST_SKIP = HOP_BY_HOP | {"host", "content-length"}
_RESPONSE_SKIP = HOP_BY_HOP | {"content-length"}
# aiohttp's client adds these when absent; a transparent proxy must not.
SKIP_AUTO_HEADERS = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")
_REQUEST_ID_OK = re.compile(r"[\x21-\x7e]{1,128}")
_STREAM_MEDIA = ("text/event-stream", "application/x-ndjson")


def _when_closed(upstream: aiohttp.ClientResponse) -> asyncio.Future[None] | None:
    """The future aiohttp resolves when the upstream connection closes (None: no connection left)."""
    connection = upstream.connection
    protocol = connection.protocol if connection is not None else None
    return protocol.closed if protocol is not None else None


def _fail_unended_body(content: aiohttp.StreamReader, closed: asyncio.Future[None]) -> None:
    """The upstream connection is gone: a body it left neither ended nor failed fails now.

    aiohttp's C parser drops a framing error mid-body (an invalid chunk size) on the floor: the
    connection closes, but the body reader would wait for ever and the record never be made.
    """
    if content.is_eof() or content.exception() is not None:
        return
    content.set_exception(aiohttp.ClientPayloadError(
        "the upstream connection closed without ending the body (invalid framing)"))


def new_request_id(supplied: str | None) -> str:
    """The client's own request id when it is a sane token, else a fresh one."""
    if supplied and _REQUEST_ID_OK.fullmatch(supplied):
        return supplied
    return uuid.uuid4().hex


def _filtered(headers: CIMultiDictProxy[str], skip: frozenset[str]) -> CIMultiDict[str]:
    connection_tokens = {t.strip().lower() for t in headers.get("Connection", "").split(",") if t.strip()}
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        lower = name.lower()
        if lower not in skip and lower not in connection_tokens:
            out.add(name, value)
    return out


def error_body(kind: str, message: str, **extra: Any) -> bytes:
    """The JSON error body the proxy itself answers with (OpenAI-style `error` object)."""
    return orjson.dumps({"error": {"type": kind, "message": message, "source": "llm-diag-proxy", **extra}})


def enforcement_event(media: str, kind: str, message: str) -> bytes:
    """A final event that makes an enforced cut visible: never a clean `[DONE]`."""
    payload = orjson.dumps({"error": {"type": kind, "message": message, "source": "llm-diag-proxy"}})
    if media == "text/event-stream":
        return b"data: " + payload + b"\n\n"
    return payload + b"\n"


MAX_STALE_RETRIES = 3


class UpstreamAttempt:
    """One try at sending a request upstream; aiohttp's tracing marks it when the connection
    came from the pool (`connection_reuse_trace`)."""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


async def _mark_reused(_session: aiohttp.ClientSession, context: SimpleNamespace,
                       _params: aiohttp.TraceConnectionReuseconnParams) -> None:
    attempt = context.trace_request_ctx
    if isinstance(attempt, UpstreamAttempt):
        attempt.reused = True


def connection_reuse_trace() -> aiohttp.TraceConfig:
    """The trace the upstream session needs so that `_Exchange._send` can tell a dead pooled
    connection (safe to send on again) from a server that failed on a fresh one (not)."""
    trace = aiohttp.TraceConfig()
    trace.on_connection_reuseconn.append(_mark_reused)
    return trace


class Forwarder:
    """The aiohttp handler of the proxy port."""

    def __init__(self, config: ProxyConfig, session: aiohttp.ClientSession, observers: ObserverChain,
                 concurrency: InFlightTracker) -> None:
        self.config = config
        self.session = session
        self.observers = observers
        self.concurrency = concurrency
        self._base = config.upstream

    async def handle(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        route, dialect = route_of(request.path)
        inference = route != OTHER_ROUTE
        record = ResponseRecord(
            request_id=new_request_id(request.headers.get(REQUEST_ID)),
            method=request.method, path=request.path[:512], route=route, dialect=dialect,
            started_at=time.time())
        slot: Slot | None = self.concurrency.admit() if inference else None
        record.concurrency_at_start = slot.at_start if slot else self.concurrency.in_flight
        record.deadline_mode = self.config.deadline_mode if self._deadlines_on else None
        run = _Exchange(self, request, record, started, inference)
        try:
            return await run.forward()
        finally:
            if slot is not None:
                record.concurrency_peak, record.concurrency_mean = self.concurrency.release(slot)
            else:
                record.concurrency_peak = record.concurrency_at_start
                record.concurrency_mean = float(record.concurrency_at_start)
            run.finish()

    @property
    def _deadlines_on(self) -> bool:
        return bool(self.config.deadline_s or self.config.idle_timeout_s)


class _Exchange:
    """One request/response pair going through the proxy."""

    def __init__(self, forwarder: Forwarder, request: web.Request, record: ResponseRecord,
                 started: float, inference: bool) -> None:
        self.fw = forwarder
        self.config = forwarder.config
        self.request = request
        self.record = record
        self.started = started
        self.inference = inference
        self.info = RequestInfo()
        self.observation = StreamObservation(None)
        self.connect_error: UpstreamErrorKind | None = None
        self.error_detail: str | None = None
        self.upstream_reset = False
        self.client_gone = False
        self.enforced = "none"
        self.observed = "none"
        self.ended_at: float | None = None
        self.notified_start = False
        self.closed_by_us = False  # we broke the client connection on purpose (upstream reset, enforcement)

    # --- request ----------------------------------------------------------------------------
    async def _request_body(self) -> bytes | AsyncIterator[bytes] | None:
        """The body to send on: whole bytes when it fits the parse cap, else a stream of it."""
        request = self.request
        if not request.body_exists:
            return None
        cap = self.config.request_body_cap_bytes
        head = bytearray()
        while True:
            chunk = await request.content.readany()
            if not chunk:
                return bytes(head)
            head += chunk
            if len(head) > cap:
                self.info.body_note = f"request body over the {cap}-byte parse cap: not parsed"
                return self._body_stream(bytes(head))

    async def _body_stream(self, head: bytes) -> AsyncIterator[bytes]:
        yield head
        async for chunk in self.request.content.iter_any():
            yield chunk

    # --- the exchange -------------------------------------------------------------------------
    async def forward(self) -> web.StreamResponse:
        try:
            body = await self._request_body()
        except (ConnectionError, aiohttp.ClientError, asyncio.IncompleteReadError) as exc:
            self.client_gone = True
            self.error_detail = f"client went away while sending the body: {type(exc).__name__}"
            raise
        if isinstance(body, bytes) and self.record.dialect != "none":
            self.info = parse_request(self.record.dialect, body)
        self._copy_request_info()
        self._notify_start()
        url = URL(self.fw._base + self.request.rel_url.raw_path_qs, encoded=True)
        headers = _filtered(self.request.headers, _REQUEST_SKIP)
        deadlines = Deadlines(self)
        try:
            async with deadlines.guard():
                upstream = await self._send(url, headers, body)
        except TimeoutError:
            if deadlines.fired:
                return self._answer(504, "deadline_exceeded", self._enforcement_message())
            self.connect_error = "timeout"
            self.error_detail = f"timed out connecting to {self.fw._base}"
            return self._answer(504, "upstream_timeout", self.error_detail)
        except aiohttp.ClientConnectorError as exc:
            self.connect_error = "connect"
            self.error_detail = f"cannot connect to {self.fw._base}: {exc.os_error or exc}"[:300]
            return self._answer(502, "upstream_unavailable", self.error_detail)
        except aiohttp.ClientResponseError as exc:  # aiohttp's parser refused the response head
            self.connect_error = "reset"
            message = " ".join(str(exc.message).split())  # llhttp messages span lines
            self.error_detail = f"upstream answered with a response that is not valid HTTP: {message}"[:300]
            return self._answer(502, "upstream_invalid_response", self.error_detail)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError) as exc:
            self.connect_error = "reset"
            self.error_detail = f"upstream closed the connection before answering: {exc}"[:300]
            return self._answer(502, "upstream_reset", self.error_detail)
        try:
            return await self._relay(upstream, deadlines)
        finally:
            upstream.close()

    async def _send(self, url: URL, headers: CIMultiDict[str],
                    body: bytes | AsyncIterator[bytes] | None) -> aiohttp.ClientResponse:
        """Send the request; again, on another connection, when a pooled one turns out dead.

        A connection the server closed while it sat in the pool fails before any response byte:
        the server was done with it, not with this request. Sending it again is what browsers do
        for any method in that case (RFC 9112 section 9.3.1 on retrying requests). Only
        replayable bodies are sent again, at most MAX_STALE_RETRIES times; the record counts
        the retries.
        """
        send = functools.partial(self.fw.session.request, self.request.method, url, headers=headers,
                                 data=body, allow_redirects=False, skip_auto_headers=SKIP_AUTO_HEADERS)
        replayable = body is None or isinstance(body, bytes)
        while True:
            attempt = UpstreamAttempt()
            try:
                return await send(trace_request_ctx=attempt)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                if not (attempt.reused and replayable and self.record.upstream_retries < MAX_STALE_RETRIES):
                    raise
            self.record.upstream_retries += 1

    def _answer(self, status: int, kind: str, message: str) -> web.Response:
        """The proxy's own JSON answer, for when the upstream gave none."""
        self.record.status = status
        response = web.Response(status=status, body=error_body(kind, message, upstream=self.fw._base),
                                content_type="application/json")
        self._stamp(response)
        return response

    def _stamp(self, response: web.StreamResponse) -> None:
        response.headers[REQUEST_ID] = self.record.request_id
        response.headers[CONCURRENCY] = str(self.record.concurrency_at_start)

    async def _relay(self, upstream: aiohttp.ClientResponse, deadlines: Deadlines) -> web.StreamResponse:
        record = self.record
        record.status = upstream.status
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                      headers=_filtered(upstream.headers, _RESPONSE_SKIP))
        if upstream.content_length is not None and "chunked" not in upstream.headers.get(
                "Transfer-Encoding", "").lower():
            response.content_length = upstream.content_length
        self._stamp(response)
        content_type = upstream.headers.get("Content-Type", "")
        media = content_type.partition(";")[0].strip().lower()
        if self.inference or upstream.status >= 400:
            self.observation = StreamObservation(parser_for(
                record.dialect, content_type, upstream.headers.get("Content-Encoding", ""),
                max_line=self.config.max_line_bytes, body_cap=self.config.response_body_cap_bytes))
        await response.prepare(self.request)
        observation = self.observation
        read = upstream.content.readany
        clock = time.monotonic
        last = clock()
        max_gap = 0.0
        closed = _when_closed(upstream)
        fail_unended = functools.partial(_fail_unended_body, upstream.content)
        if closed is not None:
            closed.add_done_callback(fail_unended)
        try:
            async with deadlines.guard():
                while True:
                    deadlines.arm(last)
                    chunk = await read()
                    deadlines.disarm()
                    now = clock()
                    if not chunk:
                        break
                    gap = now - last
                    if gap > max_gap:
                        max_gap = gap
                    last = now
                    await response.write(chunk)
                    observation.feed(chunk, now)
        except TimeoutError:
            if not deadlines.fired:
                raise
            self._finish_observation(max_gap)
            await self._end_visibly(response, media, upstream)
            return response
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            self.upstream_reset = True
            self.error_detail = f"upstream connection broke mid-body: {type(exc).__name__}: {exc}"[:300]
            self._finish_observation(max_gap)
            self._break_client_connection(response)
            return response
        except ConnectionError:
            # The client went away between two writes: a routine end, recorded as such. Re-raising
            # would make aiohttp log it as a handler error with a traceback.
            self.client_gone = True
            return response
        finally:
            if closed is not None:
                closed.remove_done_callback(fail_unended)  # pooled connections outlive the exchange
            self._finish_observation(max_gap)
        try:
            await response.write_eof()
        except ConnectionError:  # gone before the end of the body reached it, as above
            self.client_gone = True
        return response

    def _finish_observation(self, max_gap: float) -> None:
        if self.ended_at is None:
            self.ended_at = time.monotonic()
            self.observation.close(self.ended_at)
            self._note_observed(max_gap)

    async def _end_visibly(self, response: web.StreamResponse, media: str,
                           upstream: aiohttp.ClientResponse) -> None:
        """Enforce a deadline: cut the upstream and end the stream with an error event."""
        upstream.close()  # the server sees the disconnect and frees the sequence
        kind = "deadline_exceeded" if self.enforced == "total" else "idle_timeout"
        if media in _STREAM_MEDIA and response.content_length is None:
            try:
                await response.write(enforcement_event(media, kind, self._enforcement_message()))
                await response.write_eof()
            except ConnectionError:
                self.client_gone = True
        else:  # a plain body cannot carry an event: a broken connection is the visible end
            self._break_client_connection(response)

    def _break_client_connection(self, response: web.StreamResponse) -> None:
        """End the client's connection without a clean end of body, as the upstream did."""
        self.closed_by_us = True
        response.force_close()
        transport = self.request.transport
        if transport is not None:
            transport.close()

    def _enforcement_message(self) -> str:
        if self.enforced == "idle":
            return f"no bytes from the upstream for {self.config.idle_timeout_s:g} s (idle timeout)"
        return f"response exceeded the {self.config.deadline_s:g} s deadline"

    def _note_observed(self, max_gap: float) -> None:
        if self.enforced != "none":
            return
        idle = self.config.idle_timeout_s
        deadline = self.config.deadline_s
        if deadline and (self.ended_at or time.monotonic()) - self.started > deadline:
            self.observed = "total"
        elif idle and max_gap > idle:
            self.observed = "idle"

    # --- the record ---------------------------------------------------------------------------
    def _notify_start(self) -> None:
        if not self.notified_start:
            self.notified_start = True
            self.fw.observers.response_started(self.record)

    def _copy_request_info(self) -> None:
        record, info = self.record, self.info
        record.model = info.model
        record.stream = info.stream
        record.requested_max_tokens = info.requested_max_tokens
        record.seed = info.seed
        record.temperature = info.temperature
        record.num_ctx = info.num_ctx
        record.n = info.n

    def finish(self) -> None:
        """Classify, fill the record and hand it to the observers; runs exactly once per request."""
        record = self.record
        ended = self.ended_at if self.ended_at is not None else time.monotonic()
        record.duration_s = ended - self.started
        obs = self.observation
        if not self.client_gone and not self.closed_by_us and self._client_connection_lost():
            self.client_gone = True
        self._notify_start()
        record.bytes_out = obs.bytes_out
        if obs.usage is not None and obs.usage.completion_tokens is not None:
            record.output_tokens, record.tokens_source = obs.usage.completion_tokens, "usage"
        elif self.inference and (obs.tokens or obs.finish is not None or obs.done):
            record.output_tokens, record.tokens_source = obs.tokens, "counted"
        if obs.usage is not None:
            record.prompt_tokens = obs.usage.prompt_tokens
        if obs.first_token_at is not None:
            record.ttft_s = obs.first_token_at - self.started
        record.itl_mean_s, record.itl_p95_s, record.itl_max_s = obs.itl_stats()
        if obs.finish is not None:
            record.finish_reason_raw = obs.finish.reason
            record.truncated_flag = obs.finish.truncated
        timings = obs.timings
        if timings is not None:
            record.server_timings = {k: v for k, v in (
                ("total_s", timings.total_s), ("load_s", timings.load_s),
                ("prompt_eval_s", timings.prompt_eval_s), ("eval_s", timings.eval_s)) if v is not None}
            if timings.total_s is not None and record.dialect == "ollama":
                accounted = sum(v for v in (timings.load_s, timings.prompt_eval_s, timings.eval_s) if v)
                record.queue_time_s = max(0.0, timings.total_s - accounted)
                record.queue_time_source = "ollama_durations"
        record.parse_error = obs.parse_errors > 0
        record.parse_error_detail = obs.parse_error
        verdict = classify(WireFacts(
            dialect=record.dialect, inference=self.inference, status=record.status,
            connect_error=self.connect_error, error_detail=self.error_detail,
            upstream_reset=self.upstream_reset, client_disconnected=self.client_gone,
            enforced=self.enforced, finish=obs.finish, error=obs.error, done=obs.done,
            parse_failed=record.parse_error, output_tokens=record.output_tokens,
            tokens_exact=record.tokens_source != "counted",
            requested_max_tokens=record.requested_max_tokens, n=record.n,
            stop_requested=self.info.stop_requested))
        record.stop_reason = verdict.stop_reason
        record.stop_reason_certain = verdict.certain
        record.length_cause = verdict.length_cause
        record.upstream_error = verdict.upstream_error
        record.upstream_error_detail = verdict.upstream_error_detail
        if self.client_gone:
            record.client_disconnected = True
            record.disconnect_phase = "before_first_token" if obs.first_token_at is None else "mid_stream"
        hit = self.enforced if self.enforced != "none" else self.observed
        if hit != "none":
            record.deadline_hit = "total" if hit == "total" else "idle"
            record.deadline_mode = "enforce" if self.enforced != "none" else "observe"
        self.fw.observers.response_finished(record)

    def _client_connection_lost(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()


class Deadlines:
    """The enforced total deadline and idle timeout of one exchange, as rescheduled asyncio timeouts.

    Armed around reads from the upstream only, so a slow client never counts as an idle upstream.
    In observe mode nothing is armed: the exchange only notes afterwards what was passed.
    """

    __slots__ = ("_offset", "_timeout", "deadline_at", "enforce", "exchange", "fired", "idle")

    def __init__(self, exchange: _Exchange) -> None:
        self.exchange = exchange
        config = exchange.config
        self.enforce = config.deadline_mode == "enforce" and bool(config.deadline_s or config.idle_timeout_s)
        self.deadline_at = exchange.started + config.deadline_s if config.deadline_s else None
        self.idle = config.idle_timeout_s or None
        self.fired = False
        self._timeout: asyncio.Timeout | None = None
        self._offset = 0.0  # asyncio timeouts run on loop.time(); our stamps are time.monotonic()

    @contextlib.asynccontextmanager
    async def guard(self) -> AsyncIterator[None]:
        if not self.enforce:
            yield
            return
        self._offset = asyncio.get_running_loop().time() - time.monotonic()
        timeout = asyncio.timeout_at(self._at(self.deadline_at))
        self._timeout = timeout
        try:
            async with timeout:
                yield
        except TimeoutError:
            self._mark()
            raise
        finally:
            self._timeout = None

    def _at(self, when: float | None) -> float | None:
        return None if when is None else when + self._offset

    def _mark(self) -> None:
        self.fired = True
        if self.exchange.enforced == "none":
            passed = self.deadline_at is not None and time.monotonic() >= self.deadline_at - 1e-3
            self.exchange.enforced = "total" if passed else "idle"

    def arm(self, since: float) -> None:
        """Before a read: the earlier of the total deadline and `since` + the idle timeout."""
        timeout = self._timeout
        if timeout is None:
            return
        when = self.deadline_at
        if self.idle is not None:
            idle_at = since + self.idle
            if when is None or idle_at < when:
                when = idle_at
        timeout.reschedule(self._at(when))

    def disarm(self) -> None:
        """After a read: only the total deadline runs while the chunk goes to the client."""
        timeout = self._timeout
        if timeout is not None and self.idle is not None:
            timeout.reschedule(self._at(self.deadline_at))
