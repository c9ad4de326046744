"""The forwarding path: every request to the upstream and every byte back, unchanged and at once.

It moves bytes and nothing else. Each exchange has a Recorder that is fed a copy of what passes
(the request body, the response head, each chunk after it was written to the client, and how
the exchange ended); the finished record goes to the observers. Where the diagnosis fails, the
traffic does not: the record says `parse_error`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import secrets
import time
from collections.abc import Callable
from enum import Enum
from typing import Any

import aiohttp
import orjson
import structlog
from aiohttp import web
from aiohttp.http import HttpVersion10, HttpVersion11, StreamWriter
from multidict import CIMultiDict

from proxy.config import ProxyConfig
from proxy.diagnosis.clients import ClientNamer
from proxy.diagnosis.finish import Finisher
from proxy.diagnosis.recorder import ParseLimits, Recorder
from proxy.observers.logs import raised_at
from proxy.relay.admission import AdmissionGate, Refused
from proxy.relay.body_pump import BodyPump, Stop
from proxy.relay.deadlines import Deadlines
from proxy.relay.http1 import (
    REQUEST_SKIP,
    RESPONSE_SKIP,
    Refusal,
    end_to_end,
    only_chunked,
    origin_target,
    request_refusal,
    response_head,
    trailer_section,
)
from proxy.relay.in_flight import InFlightTracker, Slot
from proxy.relay.listeners import OwnResponse
from proxy.relay.request_body import Outgoing, RequestBody
from proxy.relay.upstream.connection import InvalidResponse, UpstreamUnreachable
from proxy.relay.upstream.pool import SendCount, UpstreamPool, UpstreamResponse
from proxy.wire.parse_bytes import ParseBytes
from proxy.wire.parsers import Read

_log = structlog.get_logger("llm_diag_proxy")
REQUEST_ID = "X-Request-Id"
CONCURRENCY = "X-LLM-Diag-Concurrency"
_REQUEST_ID_OK = re.compile(r"[\x21-\x7e]{1,128}")
_STREAM_MEDIA = ("text/event-stream", "application/x-ndjson")
_BROKEN_UPSTREAM = (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
# What reading the request raises when its client went away (recorded where it is seen).
_CLIENT_GONE = (ConnectionError, aiohttp.ClientError, asyncio.IncompleteReadError)


class _FreshIds:
    """Request ids as long as a uuid4's hex, unique without a syscall each: 80 random bits per
    process (drawn again in a forked child), then a counter."""

    def __init__(self) -> None:
        self._draw()
        os.register_at_fork(after_in_child=self._draw)

    def _draw(self) -> None:
        self._prefix = os.urandom(10).hex()
        self._count = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._count):012x}"


_fresh_ids = _FreshIds()


def new_request_id(supplied: str | None) -> str:
    """The client's own request id when it is a sane token, else a fresh one."""
    if supplied and _REQUEST_ID_OK.fullmatch(supplied):
        return supplied
    return _fresh_ids.next()


def _unread(data: bytes, now: float) -> None:
    """The pump's sink before the record reads the answer (`_Exchange._read_answer` replaces it)."""


def error_body(kind: str, message: str, **extra: Any) -> bytes:
    """The JSON error body the proxy itself answers with (OpenAI-style `error` object)."""
    return orjson.dumps({"error": {"type": kind, "message": message, "source": "llm-diag-proxy", **extra}})


def enforcement_event(media: str, kind: str, message: str) -> bytes:
    """A final event that makes an enforced cut visible: never a clean `[DONE]`."""
    payload = orjson.dumps({"error": {"type": kind, "message": message, "source": "llm-diag-proxy"}})
    if media == "text/event-stream":
        return b"data: " + payload + b"\n\n"
    return payload + b"\n"


class Ending(Enum):
    """How a relayed body ended."""

    BODY_ENDED = "body_ended"  # the upstream's end, relayed
    DEADLINE = "deadline"  # a deadline (or the shutdown) ended it: ended visibly
    UPSTREAM_BROKE = "upstream_broke"  # the upstream's connection broke: the client's is broken too
    CLIENT_LEFT = "client_left"  # the client's connection closed under a write


class RelayedResponse(web.StreamResponse):
    """The upstream's response head as aiohttp sends it, less what aiohttp adds to a head the
    upstream sent without it: `Content-Type` (a guess), `Date` (the upstream's clock or none) and
    `Server` (it names aiohttp's version): a proxy passes on what the server said."""

    added: frozenset[str] = frozenset()  # the fields aiohttp adds that the upstream did not send

    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        for name in self.added:
            self.headers.popall(name, None)

    async def _write_headers(self) -> None:
        """aiohttp's, with the head's bytes made as `start_chunked` makes them: aiohttp's serializer
        drops a header byte that is not UTF-8 (`caf\\xe9` went out as `caf`), the relay passes it on.
        (The answers `start_chunked` does not take: a length, an HTTP/1.0 client, a body up to the close.)"""
        request, writer = self._req, self._payload_writer
        if request is None or not isinstance(writer, StreamWriter):
            await super()._write_headers()
            return
        version = request.version
        status_line = f"HTTP/{version[0]}.{version[1]} {self.status} {self.reason}"
        # (its hook and its checks, as before; its pure-Python serializer refuses such a byte, the C one drops it)
        with contextlib.suppress(UnicodeEncodeError):
            await writer.write_headers(status_line, self.headers)
        writer._headers_buf, writer._headers_written = response_head(status_line, self.headers), False
        if self._send_headers_immediately:
            writer.send_headers()

    def start_chunked(self, request: web.BaseRequest, writer: StreamWriter) -> bytes:
        """`prepare()` for the relay's usual answer, an HTTP/1.1 client and a chunked body that
        can have content, with the head returned to go out with the body's first bytes (one write
        instead of two: `BodyPump.start`). The same head `prepare()` writes: the fields as they
        stand, `Transfer-Encoding: chunked`, `Connection: close` when the connection ends after it;
        nothing of what aiohttp adds to a head. The response is then prepared as far as aiohttp is
        concerned: its writer chunks what is written through it, and `write_eof` ends it."""
        self._req = request
        self._payload_writer = writer
        keep_alive = self._keep_alive
        if keep_alive is None:
            keep_alive = self._keep_alive = request.keep_alive
        writer.enable_chunking()
        headers = self.headers
        headers["Transfer-Encoding"] = "chunked"
        if not keep_alive and "Connection" not in headers:
            headers["Connection"] = "close"
        return response_head(f"HTTP/1.1 {self.status} {self.reason}", headers)


_ADDED_BY_AIOHTTP = ("Content-Type", "Date", "Server")


class Forwarder:
    """The aiohttp handler of the proxy port."""

    def __init__(self, config: ProxyConfig, finisher: Finisher, concurrency: InFlightTracker,
                 parse_bytes: ParseBytes, on_refused: Callable[[str], None] = lambda reason: None,
                 gate: AdmissionGate | None = None,
                 on_not_admitted: Callable[[str], None] = lambda reason: None) -> None:
        self.config = config
        self.on_refused = on_refused  # a request refused before it went upstream, by a bounded reason
        self.gate = gate  # the admission gate (--max-in-flight; None or open: every generation goes at once)
        self.on_not_admitted = on_not_admitted  # a generation the gate refused, by reason
        self.pool = UpstreamPool(config.upstream, config.connect_timeout_s)
        self.clients = ClientNamer(config.client_secret or secrets.token_bytes(32), config.client_header)
        self.finisher = finisher  # the diagnosis's side: each exchange's start and end
        self.concurrency = concurrency
        self.parse_bytes = parse_bytes
        self.limits = ParseLimits(config.max_line_bytes, config.response_body_cap_bytes, parse_bytes)
        self.active: set[Deadlines] = set()  # one per exchange in progress: what shutdown() ends
        self.shutting_down = False

    async def close(self) -> None:
        """Close the pooled connections to the upstream."""
        await self.pool.close()

    def refuse_new(self) -> None:
        """From now on, answer every new request 503 `proxy_shutdown` (the proxy is stopping)."""
        self.shutting_down = True

    def end_active(self) -> None:
        """End every exchange still open, visibly: a final error event, or a 503 before any head."""
        for deadlines in list(self.active):
            deadlines.shutdown()

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        refusal = request_refusal(request.method, request.version, request.raw_path,
                                  request.headers.get("Transfer-Encoding"))
        if refusal is not None:
            return self._refuse(request, refusal)
        started = time.monotonic()
        config = self.config
        deadlines = Deadlines(started, config.deadline_s, config.idle_timeout_s, config.deadline_mode == "enforce")
        if self.shutting_down:
            deadlines.shutdown()
        exchange = _Exchange(self, request, started, deadlines)
        gate = self.gate
        # A generation the gate holds is admitted once it has its place (after its body is read: the
        # record names its model); every other request at once, as without a gate.
        exchange.gated = gate is not None and gate.on and exchange.inference
        if not exchange.gated:
            exchange.admit()
        self.active.add(deadlines)
        try:
            return await exchange.forward()
        except Exception as exc:  # (a cancellation, the client gone, is not the proxy's failure)
            if exchange.recorder.client_has_left and isinstance(exc, _CLIENT_GONE):
                return exchange.gone()
            return exchange.failed(exc)
        finally:
            self.active.discard(deadlines)
            exchange.release()
            exchange.body.release()
            exchange.finish()

    def _refuse(self, request: web.BaseRequest, refusal: Refusal) -> web.StreamResponse:
        """A request the relay does not forward: a JSON error, counted, one log line, the connection
        closed (what follows on it cannot be framed). A request line without a version is answered
        as HTTP/1.1: aiohttp would answer in the request's own version, `HTTP/0.9 400`."""
        self.on_refused(refusal.reason)
        _log.warning("refused_request", reason=refusal.reason, method=request.method[:16], status=refusal.status)
        response = OwnResponse(status=refusal.status, body=error_body(refusal.kind, refusal.message),
                               content_type="application/json",
                               headers={"Allow": "GET, HEAD, POST, PUT, DELETE, OPTIONS, PATCH"}
                               if refusal.status == 405 else None)
        response.force_close()
        if refusal.reason == "connect":
            # A CONNECT's content is a tunnel's bytes, without end: aiohttp's pure-Python parser (no
            # C extensions) gives it a body that never ends, and aiohttp then lingers on it for its
            # lingering time (10 s) before the close. Nothing of it is read: it ends here.
            request.content.feed_eof()
        transport = request.transport
        if request.version < HttpVersion10 and transport is not None:
            # Written here, whole; aiohttp's own write of `response` then meets a closed connection,
            # which it takes quietly (a client gone).
            body = error_body(refusal.kind, refusal.message)
            transport.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                            b"Connection: close\r\n\r\n%s" % (refusal.status, response.reason.encode(), len(body),
                                                                 body))
            transport.close()
        return response


class _Exchange:
    """One request/response pair going through the proxy.

    The first token's way carries only what it needs. The record is made once the request is on
    its way upstream (`recorder`, at the latest where something must be recorded sooner: the
    gate, a failure), so that the server works on the request meanwhile; the answer is read for
    the record once its first bytes went out to the client (`_relay`)."""

    def __init__(self, forwarder: Forwarder, request: web.BaseRequest, started: float,
                 deadlines: Deadlines) -> None:
        self.pool = forwarder.pool
        self.finisher = forwarder.finisher
        self.base = forwarder.config.upstream
        self.authorization = forwarder.config.upstream_authorization
        self.body_cap = forwarder.config.request_body_cap_bytes
        self.body = RequestBody(request, forwarder.parse_bytes)
        self.request = request
        self.request_id = new_request_id(request.headers.get(REQUEST_ID))
        self.started = started  # monotonic, and in unix time:
        self.started_at = time.time()
        self.route = Recorder.routed(request.path)
        self.inference = Recorder.reads(self.route)  # a generation in a dialect the proxy reads
        self._recorder: Recorder | None = None
        self.deadlines = deadlines
        self.max_gap = 0.0
        self.notified_start = False
        self.closed_by_us = False  # we broke the client connection on purpose (upstream reset, enforcement)
        self.forwarder = forwarder
        self.gated = False  # it waits for a place at the admission gate
        self.entered = False  # it has its place there (to give back when it ends)
        self.admitted = False  # counted in flight (`admit`): the record is told when it is made
        self.slot: Slot | None = None
        self.at_start = 0
        self.response: web.StreamResponse | None = None  # the relayed answer, once its head is on its way
        # The answer's head (status, media type, coding, length), until the record reads it:
        self.answer_head: tuple[int, str, str, int | None] | None = None

    @property
    def recorder(self) -> Recorder:
        """The exchange's recorder, made on first use (see the class's docstring)."""
        recorder = self._recorder
        if recorder is None:
            forwarder, request = self.forwarder, self.request
            config = forwarder.config
            recorder = self._recorder = Recorder.start(
                self.request_id, request.method, request.path, limits=forwarder.limits, started=self.started,
                started_at=self.started_at, routed=self.route, instance=config.instance, upstream=config.upstream,
                client=forwarder.clients.name(request.headers))
            recorder.trace_context(request.headers.get("traceparent"))  # forwarded unchanged like every header
            if self.admitted:
                self._tell_admitted(recorder)
        return recorder

    # --- admission ----------------------------------------------------------------------------
    def admit(self) -> None:
        """Counted in flight (a generation), with the deadlines' mode on the record."""
        tracker = self.forwarder.concurrency
        self.slot = tracker.admit() if self.inference else None
        self.at_start = self.slot.at_start if self.slot is not None else tracker.in_flight
        self.admitted = True
        if self._recorder is not None:
            self._tell_admitted(self._recorder)

    def _tell_admitted(self, recorder: Recorder) -> None:
        config = self.forwarder.config
        recorder.admitted(self.at_start, config.deadline_mode if config.deadline_s or config.idle_timeout_s else None)

    async def wait_for_place(self) -> web.Response | None:
        """The gate's queue, fair across clients: None once admitted, else the proxy's 503."""
        gate = self.forwarder.gate
        assert gate is not None
        try:
            waited = await gate.enter(self.recorder.record.client)
        except Refused as refused:
            self.forwarder.on_not_admitted(refused.reason)
            self.admit()  # (as a request that went nowhere: the concurrency it met)
            self.recorder.not_admitted(refused.detail)
            retry_after = max(1, round(gate.settings.queue_timeout_s or 1))
            response = OwnResponse(status=503, body=error_body("admission_refused", refused.detail,
                                                               reason=refused.reason),
                                   content_type="application/json", headers={"Retry-After": str(retry_after)})
            self._stamp(response)
            return response
        except asyncio.CancelledError:
            self.recorder.client_left("the client went away while it waited at the proxy's admission gate")
            raise
        self.entered = True
        self.recorder.queued_at_proxy(waited)
        self.admit()
        return None

    def release(self) -> None:
        if self.entered and self.forwarder.gate is not None:
            self.forwarder.gate.leave()
        slot = self.slot
        tracker = self.forwarder.concurrency
        peak, mean = tracker.release(slot) if slot is not None else (self.at_start, float(self.at_start))
        self.recorder.concurrency(self.at_start, peak, mean)

    # --- the exchange -------------------------------------------------------------------------
    async def forward(self) -> web.StreamResponse:
        body = self.body
        try:
            await body.read(self.body_cap)
        except _CLIENT_GONE as exc:
            self.recorder.client_left(f"client went away while sending the body: {type(exc).__name__}")
            raise
        if self.gated:
            self._read_request()  # (the record names the model it waits for)
            refused = await self.wait_for_place()
            if refused is not None:
                return refused
        headers = end_to_end(self.request.headers, REQUEST_SKIP, self.request.raw_headers)
        # The proxy's request id goes upstream, so both sides name the request alike; the client's
        # own Authorization wins over credentials given in the upstream URL.
        headers[REQUEST_ID] = self.request_id
        if self.authorization is not None and "Authorization" not in headers:
            headers["Authorization"] = self.authorization
        try:
            try:
                async with self.deadlines.guard():
                    upstream = await self._send(headers, body.outgoing(headers))
            finally:
                self._read_request()  # (sent or not: the record reads what was asked)
        except TimeoutError:
            recorder = self.recorder
            fired = self.deadlines.fired
            if fired == "shutdown":
                recorder.proxy_shutdown(status=503)
                return self._answer(503, "proxy_shutdown", self.deadlines.message())
            if fired is not None:
                recorder.deadline_enforced(fired, status=504)
                return self._answer(504, "deadline_exceeded", self.deadlines.message())
            detail = f"timed out connecting to {self.base}"
            recorder.no_answer("timeout", detail, 504)
            return self._answer(504, "upstream_timeout", detail)
        except UpstreamUnreachable as exc:
            recorder = self.recorder
            detail = f"cannot connect to {self.base}: {exc.os_error}"[:300]
            recorder.no_answer("connect", detail, 502)
            return self._answer(502, "upstream_unavailable", detail)
        except InvalidResponse as exc:  # the parser refused the response head
            recorder = self.recorder
            message = " ".join(str(exc.message).split())  # llhttp messages span lines
            detail = f"upstream answered with a response that is not valid HTTP: {message}"[:300]
            recorder.no_answer("reset", detail, 502)
            return self._answer(502, "upstream_invalid_response", detail)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError) as exc:
            recorder = self.recorder
            detail = f"upstream closed the connection before answering: {exc}"[:300]
            recorder.no_answer("reset", detail, 502)
            return self._answer(502, "upstream_reset", detail)
        try:
            return await self._relay(upstream)
        finally:
            upstream.close()

    async def _send(self, headers: CIMultiDict[str], body: Outgoing) -> UpstreamResponse:
        """Send the request once; the record counts a send again.

        A pooled connection the server closed while idle is never written on (see
        `relay.upstream.pool`). One that dies under a request anyway may have carried it
        to the server: an idempotent request with a held body goes once more on another
        connection, and a POST never, so a server never generates twice.
        """
        count = SendCount()
        try:
            request = self.request
            return await self.pool.send(request.method, origin_target(request.raw_path, request.rel_url.raw_path_qs),
                                        headers, body, count, written=self._read_request)
        finally:
            self.recorder.sent(count.retries)

    def _read_request(self) -> None:
        """The record made, the request body read for it and the exchange's start told, once: as
        soon as the request is on its way upstream (the pool calls it after its write), so that the
        server works on it meanwhile and the first token waits for none of them. (Its start is told
        right after: once it is, the request was read, or never will be.)"""
        if self.notified_start:
            return
        self.recorder.request_body(self.body.held, self.body.note)
        self._notify_start()  # (after the body: the record names the model it asks for)

    def _answer(self, status: int, kind: str, message: str) -> web.Response:
        """The proxy's own JSON answer, for when the upstream gave none."""
        response = OwnResponse(status=status, body=error_body(kind, message, upstream=self.base),
                               content_type="application/json")
        self._stamp(response)
        return response

    def _stamp(self, response: web.StreamResponse) -> None:
        """The proxy's two headers: its request id unless the upstream sent its own, and the concurrency."""
        record = self.recorder.record
        theirs = response.headers.get(REQUEST_ID)
        if theirs is None:
            response.headers[REQUEST_ID] = record.request_id
        else:
            self.recorder.upstream_named(theirs)
        response.headers[CONCURRENCY] = str(record.concurrency_at_start)

    async def _relay(self, upstream: UpstreamResponse) -> web.StreamResponse:
        recorder, deadlines = self.recorder, self.deadlines
        coding = upstream.headers.get("Transfer-Encoding")
        if not only_chunked(coding):
            # The proxy reframes a body as chunked: gzip or another coding under it would be lost.
            detail = "upstream answered with a transfer coding other than chunked, which the proxy does not relay"
            recorder.no_answer("reset", detail, 502)
            return self._answer(502, "upstream_invalid_response", detail)
        response = RelayedResponse(status=upstream.status, reason=upstream.reason,
                                   headers=end_to_end(upstream.headers, RESPONSE_SKIP, upstream.raw_headers))
        response.added = frozenset(name for name in _ADDED_BY_AIOHTTP if name not in upstream.headers)
        length = upstream.content_length
        chunked = coding is not None
        if length is not None and not chunked:
            response.content_length = length
        else:
            length = None
            self.pool.streamed(upstream)
        self._stamp(response)
        content_type = upstream.headers.get("Content-Type", "")
        self.answer_head = (upstream.status, content_type, upstream.headers.get("Content-Encoding", ""), length)
        request, writer = self.request, self.request.writer
        head = b""
        self.response = response  # (from here aiohttp's writer is the answer's: no other can follow)
        try:
            if upstream.protocol.raw_body and request.version == HttpVersion11 and isinstance(writer, StreamWriter):
                if self._client_connection_lost():  # (what aiohttp's writer raises)
                    raise ConnectionResetError("Cannot write to closing transport")
                head = response.start_chunked(request, writer)  # (written with the body's first bytes)
            else:
                await response.prepare(request)
        except ConnectionError:  # gone while the server thought: a routine end, recorded as such
            recorder.client_left()
            return response
        pump = BodyPump(upstream.content, upstream.protocol, request.protocol,
                        isinstance(writer, StreamWriter) and writer.chunked, _unread, deadlines,
                        time.monotonic(), head, begin=self._read_answer)
        ending, error = await self._pump(pump)
        if ending is Ending.DEADLINE:
            fired = deadlines.fired
            if fired == "shutdown" or fired is None:
                recorder.proxy_shutdown()
            else:
                recorder.deadline_enforced(fired)
            await self._end_visibly(response, content_type.partition(";")[0].strip().lower(), upstream)
        elif ending is Ending.UPSTREAM_BROKE:
            recorder.upstream_broke(f"upstream connection broke mid-body: {type(error).__name__}: {error}"[:300])
            self._break_client_connection(response)
        elif ending is Ending.CLIENT_LEFT:
            # The client went away between two writes: a routine end, recorded as such. Raising
            # would make aiohttp log it as a handler error with a traceback.
            recorder.client_left()
        else:
            await self._end_body(response, upstream, pump.relays_framing, chunked)
        return response

    def _read_answer(self) -> tuple[Callable[[bytes, float], None], Callable[[list[Read], int], None]]:
        """The answer's head to the record, once, and where its body goes: the pump calls it after
        its first write, `finish` at the latest."""
        recorder = self.recorder
        answer_head, self.answer_head = self.answer_head, None
        if answer_head is not None:
            recorder.response_head(*answer_head)
        return recorder.chunk_sink, recorder.reads_sink

    async def _pump(self, pump: BodyPump) -> tuple[Ending, BaseException | None]:
        """Run the pump to the body's end, the client's pace and the deadlines minded; how it ended
        (and the upstream's error when it broke). The pump is detached and the body's end noted,
        once, whatever ended it."""
        deadlines, writer = self.deadlines, self.request.writer
        try:
            async with deadlines.guard():
                pump.start()
                while True:
                    deadlines.arm(pump.last)
                    await pump.waiter
                    if pump.stopped is not Stop.PAUSED:
                        break
                    deadlines.disarm()  # a slow client is not an idle upstream
                    await writer.drain()
                    pump.resume()
        except TimeoutError:
            if deadlines.fired is None:
                raise
            return Ending.DEADLINE, None
        except ConnectionError:
            return Ending.CLIENT_LEFT, None
        finally:
            pump.detach()
            self.recorder.body_ended(pump.ended_at or time.monotonic())
            self.max_gap = pump.max_gap
        if pump.stopped is Stop.FAILED:
            assert pump.error is not None
            raise pump.error  # (the exchange's own failure: `Forwarder.handle` ends it, proxy_error)
        if pump.stopped is Stop.CLIENT_LEFT:
            return Ending.CLIENT_LEFT, None
        if pump.stopped is Stop.BROKE:
            error = pump.error
            return Ending.UPSTREAM_BROKE, (error if isinstance(error, _BROKEN_UPSTREAM)
                                           else aiohttp.ClientPayloadError(str(error)))
        return Ending.BODY_ENDED, None

    async def _end_body(self, response: web.StreamResponse, upstream: UpstreamResponse, relays_framing: bool,
                        chunked: bool) -> None:
        """The body's clean end: the last chunk as it came (with the upstream's trailers), or aiohttp's."""
        writer = self.request.writer
        try:
            if relays_framing:
                assert isinstance(writer, StreamWriter)
                writer.chunked = False  # the last chunk and its trailers went as they came
            trailers = trailer_section(upstream.protocol.raw_tail()) if chunked and not relays_framing else None
            if trailers is not None and isinstance(writer, StreamWriter) and writer.chunked:
                await self._end_with_trailers(response, writer, trailers)
            await response.write_eof()
        except ConnectionError:  # gone before the end of the body reached it
            self.recorder.client_left()

    @staticmethod
    async def _end_with_trailers(response: web.StreamResponse, writer: StreamWriter, trailers: bytes) -> None:
        """The last chunk with the upstream's trailer fields, as they came: aiohttp's own end of a
        chunked body has no room for them, so the end is written here and the writer told so."""
        writer.chunked = False  # what follows goes out as it is: the last chunk and the trailer section
        await response.write(b"0\r\n" + trailers + b"\r\n")

    async def _end_visibly(self, response: web.StreamResponse, media: str,
                           upstream: UpstreamResponse) -> None:
        """Enforce a deadline: cut the upstream and end the stream with an error event."""
        upstream.close()  # the server sees the disconnect and frees the sequence
        fired = self.deadlines.fired
        kind = {"total": "deadline_exceeded", "idle": "idle_timeout"}.get(fired or "", "proxy_shutdown")
        if media in _STREAM_MEDIA and response.content_length is None:
            try:
                await response.write(enforcement_event(media, kind, self.deadlines.message()))
                await response.write_eof()
            except ConnectionError:
                self.recorder.client_left()
        else:  # a plain body cannot carry an event: a broken connection is the visible end
            self._break_client_connection(response)

    def _break_client_connection(self, response: web.StreamResponse) -> None:
        """End the client's connection without a clean end of body, as the upstream did."""
        self.closed_by_us = True
        response.force_close()
        transport = self.request.transport
        if transport is not None:
            transport.close()

    def gone(self) -> web.StreamResponse:
        """The client went away while its request was read (recorded where it was seen): nothing
        can reach it, and the connection ends."""
        response = OwnResponse(status=400)
        response.force_close()
        return response

    def failed(self, error: Exception) -> web.StreamResponse:
        """The proxy's own code failed on this exchange. The client is never left waiting on it: a
        502 before the answer's head, after it a broken connection (as from an upstream that
        broke; aiohttp's own 500 would land inside the relayed body). Said once in the log and on
        the record (`proxy_error`), by the error's type and where it was raised: never its text,
        which can hold what the exchange carried."""
        where = raised_at(error) or "unknown"
        detail = f"the proxy failed on this exchange ({type(error).__name__} at {where}) and ended it"
        _log.error("exchange_failed", request_id=self.recorder.record.request_id, error=type(error).__name__,
                   at=where)
        response = self.response
        if response is None:
            self.recorder.proxy_failed(detail, status=502)
            return self._answer(502, "proxy_error", detail)
        self.recorder.proxy_failed(detail)
        self._break_client_connection(response)
        return response

    # --- the record ---------------------------------------------------------------------------
    def _notify_start(self) -> None:
        if not self.notified_start:
            self.notified_start = True
            self.finisher.started(self.recorder.record)

    def finish(self) -> None:
        """Hand the finished record to the observers; runs exactly once per request."""
        recorder = self.recorder
        if self.answer_head is not None:
            self._read_answer()
        if not recorder.client_has_left and not self.closed_by_us and self._client_connection_lost():
            recorder.client_left()
        self._notify_start()
        recorder.body_ended(time.monotonic())
        ended = recorder.ended_at
        assert ended is not None
        passed = self.deadlines.passed(ended, self.max_gap)
        if passed is not None:
            recorder.deadline_observed(passed)
        self.finisher.ended(recorder, self.request.headers.get("Authorization"))  # (what it is made of is fixed now)

    def _client_connection_lost(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()
