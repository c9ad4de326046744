"""The forwarding path: every request to the upstream and every byte back, unchanged and at once.

It moves bytes and nothing else. Each exchange has a Recorder that is fed a copy of what passes
(the request body, the response head, each chunk after it was written to the client, and how
the exchange ended); the finished record goes to the observers. Where the diagnosis fails, the
traffic does not: the record says `parse_error`.
"""

from __future__ import annotations

import asyncio
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

from proxy.concurrency import InFlightTracker
from proxy.config import ProxyConfig
from proxy.deadlines import Deadlines
from proxy.observers import ObserverChain
from proxy.recorder import ParseLimits, Recorder

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
MAX_STALE_RETRIES = 3
_BROKEN_UPSTREAM = (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


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
        self.limits = ParseLimits(config.max_line_bytes, config.response_body_cap_bytes)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        recorder = Recorder.start(new_request_id(request.headers.get(REQUEST_ID)), request.method,
                                  request.path, limits=self.limits, started=started)
        tracker = self.concurrency
        slot = tracker.admit() if recorder.inference else None
        at_start = slot.at_start if slot is not None else tracker.in_flight
        recorder.record.concurrency_at_start = at_start
        config = self.config
        deadlines = Deadlines(started, config.deadline_s, config.idle_timeout_s, config.deadline_mode == "enforce")
        if config.deadline_s or config.idle_timeout_s:
            recorder.record.deadline_mode = config.deadline_mode
        exchange = _Exchange(self, request, recorder, deadlines)
        try:
            return await exchange.forward()
        finally:
            peak, mean = tracker.release(slot) if slot is not None else (at_start, float(at_start))
            recorder.concurrency(at_start, peak, mean)
            exchange.finish()


class _Exchange:
    """One request/response pair going through the proxy."""

    def __init__(self, forwarder: Forwarder, request: web.Request, recorder: Recorder,
                 deadlines: Deadlines) -> None:
        self.session = forwarder.session
        self.observers = forwarder.observers
        self.base = forwarder.config.upstream
        self.body_cap = forwarder.config.request_body_cap_bytes
        self.request = request
        self.recorder = recorder
        self.deadlines = deadlines
        self.max_gap = 0.0
        self.notified_start = False
        self.closed_by_us = False  # we broke the client connection on purpose (upstream reset, enforcement)

    # --- the request ------------------------------------------------------------------------
    async def _request_body(self) -> bytes | AsyncIterator[bytes] | None:
        """The body to send on: whole bytes when it fits the parse cap, else a stream of it."""
        request = self.request
        if not request.body_exists:
            self.recorder.request_body(None)
            return None
        cap = self.body_cap
        head = bytearray()
        while True:
            chunk = await request.content.readany()
            if not chunk:
                body = bytes(head)
                self.recorder.request_body(body)
                return body
            head += chunk
            if len(head) > cap:
                self.recorder.request_body(None, f"request body over the {cap}-byte parse cap: not parsed")
                return self._body_stream(bytes(head))

    async def _body_stream(self, head: bytes) -> AsyncIterator[bytes]:
        yield head
        async for chunk in self.request.content.iter_any():
            yield chunk

    # --- the exchange -------------------------------------------------------------------------
    async def forward(self) -> web.StreamResponse:
        recorder = self.recorder
        try:
            body = await self._request_body()
        except (ConnectionError, aiohttp.ClientError, asyncio.IncompleteReadError) as exc:
            recorder.client_left(f"client went away while sending the body: {type(exc).__name__}")
            raise
        self._notify_start()
        url = URL(self.base + self.request.rel_url.raw_path_qs, encoded=True)
        headers = _filtered(self.request.headers, _REQUEST_SKIP)
        try:
            async with self.deadlines.guard():
                upstream = await self._send(url, headers, body)
        except TimeoutError:
            if self.deadlines.fired is not None:
                recorder.deadline_enforced(self.deadlines.fired, status=504)
                return self._answer(504, "deadline_exceeded", self.deadlines.message())
            detail = f"timed out connecting to {self.base}"
            recorder.no_answer("timeout", detail, 504)
            return self._answer(504, "upstream_timeout", detail)
        except aiohttp.ClientConnectorError as exc:
            detail = f"cannot connect to {self.base}: {exc.os_error or exc}"[:300]
            recorder.no_answer("connect", detail, 502)
            return self._answer(502, "upstream_unavailable", detail)
        except aiohttp.ClientResponseError as exc:  # aiohttp's parser refused the response head
            message = " ".join(str(exc.message).split())  # llhttp messages span lines
            detail = f"upstream answered with a response that is not valid HTTP: {message}"[:300]
            recorder.no_answer("reset", detail, 502)
            return self._answer(502, "upstream_invalid_response", detail)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError) as exc:
            detail = f"upstream closed the connection before answering: {exc}"[:300]
            recorder.no_answer("reset", detail, 502)
            return self._answer(502, "upstream_reset", detail)
        try:
            return await self._relay(upstream)
        finally:
            upstream.close()

    async def _send(self, url: URL, headers: CIMultiDict[str],
                    body: bytes | AsyncIterator[bytes] | None) -> aiohttp.ClientResponse:
        """Send the request; again, on another connection, when a pooled one turns out dead.

        A connection the server closed while it sat in the pool fails before any response byte:
        the server was done with it, not with this request. Only replayable bodies are sent
        again, at most MAX_STALE_RETRIES times; the record counts the retries.
        """
        send = functools.partial(self.session.request, self.request.method, url, headers=headers,
                                 data=body, allow_redirects=False, skip_auto_headers=SKIP_AUTO_HEADERS)
        replayable = body is None or isinstance(body, bytes)
        record = self.recorder.record
        while True:
            attempt = UpstreamAttempt()
            try:
                return await send(trace_request_ctx=attempt)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                if not (attempt.reused and replayable and record.upstream_retries < MAX_STALE_RETRIES):
                    raise
            record.upstream_retries += 1

    def _answer(self, status: int, kind: str, message: str) -> web.Response:
        """The proxy's own JSON answer, for when the upstream gave none."""
        response = web.Response(status=status, body=error_body(kind, message, upstream=self.base),
                                content_type="application/json")
        self._stamp(response)
        return response

    def _stamp(self, response: web.StreamResponse) -> None:
        record = self.recorder.record
        response.headers[REQUEST_ID] = record.request_id
        response.headers[CONCURRENCY] = str(record.concurrency_at_start)

    async def _relay(self, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        recorder, deadlines = self.recorder, self.deadlines
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                      headers=_filtered(upstream.headers, _RESPONSE_SKIP))
        if upstream.content_length is not None and "chunked" not in upstream.headers.get(
                "Transfer-Encoding", "").lower():
            response.content_length = upstream.content_length
        self._stamp(response)
        content_type = upstream.headers.get("Content-Type", "")
        recorder.response_head(upstream.status, content_type, upstream.headers.get("Content-Encoding", ""))
        await response.prepare(self.request)
        feed = recorder.chunk
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
                    feed(chunk, now)
        except TimeoutError:
            if deadlines.fired is None:
                raise
            recorder.deadline_enforced(deadlines.fired)
            recorder.body_ended(clock())
            await self._end_visibly(response, content_type.partition(";")[0].strip().lower(), upstream)
            return response
        except _BROKEN_UPSTREAM as exc:
            recorder.upstream_broke(f"upstream connection broke mid-body: {type(exc).__name__}: {exc}"[:300])
            recorder.body_ended(clock())
            self._break_client_connection(response)
            return response
        except ConnectionError:
            # The client went away between two writes: a routine end, recorded as such. Re-raising
            # would make aiohttp log it as a handler error with a traceback.
            recorder.client_left()
            return response
        finally:
            if closed is not None:
                closed.remove_done_callback(fail_unended)  # pooled connections outlive the exchange
            recorder.body_ended(clock())
            self.max_gap = max_gap
        try:
            await response.write_eof()
        except ConnectionError:  # gone before the end of the body reached it, as above
            recorder.client_left()
        return response

    async def _end_visibly(self, response: web.StreamResponse, media: str,
                           upstream: aiohttp.ClientResponse) -> None:
        """Enforce a deadline: cut the upstream and end the stream with an error event."""
        upstream.close()  # the server sees the disconnect and frees the sequence
        kind = "deadline_exceeded" if self.deadlines.fired == "total" else "idle_timeout"
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

    # --- the record ---------------------------------------------------------------------------
    def _notify_start(self) -> None:
        if not self.notified_start:
            self.notified_start = True
            self.observers.response_started(self.recorder.record)

    def finish(self) -> None:
        """Hand the finished record to the observers; runs exactly once per request."""
        recorder = self.recorder
        if not recorder.client_gone and not self.closed_by_us and self._client_connection_lost():
            recorder.client_left()
        self._notify_start()
        recorder.body_ended(time.monotonic())
        ended = recorder.ended_at
        assert ended is not None
        passed = self.deadlines.passed(ended, self.max_gap)
        if passed is not None:
            recorder.deadline_observed(passed)
        self.observers.response_finished(recorder.finish())

    def _client_connection_lost(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()
