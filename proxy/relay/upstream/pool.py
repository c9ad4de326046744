"""The pool of HTTP/1.1 connections to the upstream, and the sending of one request on it.

It writes each request head itself, in one write with a held body, and reads the answer through
the connection (aiohttp's response protocol and parser, see .connection): the same framing,
limits and errors as aiohttp's client, without the generality of its ClientSession (cookies,
redirects, proxies, traces, a request object per send), which cost more CPU per request than the
diagnosis.

Connections are pooled: a fresh one per request costs a connect and an accept on the critical
path of every first token. A pooled connection idles at most POOLED_IDLE_S, less than the
keep-alive timeouts of uvicorn (vLLM) and cpp-httplib (llama-server), 5 s each. A server may still
close one while it sits in the pool: the pool asks each connection whether it is available before
it carries a request (settled, open, not closed by the server, not quiet too long by the kernel's
clock), and opens a fresh one instead, so a request is never written into a closed socket and
never has to be sent twice.

A request that dies on a pooled connection before one byte of its answer came is sent once more on
another connection when its method is idempotent (RFC 9112 section 9.3.1) and its body is held; a
POST never, so a server never generates twice.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Callable
from urllib.parse import urlsplit

from aiohttp.client_exceptions import ClientOSError, ServerDisconnectedError
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.streams import StreamReader
from aiohttp.typedefs import RawHeaders
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from proxy.relay.http1 import request_head, upstream_target
from proxy.relay.request_body import Outgoing
from proxy.relay.upstream.connection import Connection, InvalidResponse, UpstreamUnreachable

POOLED_IDLE_S = 3.0
SWEEP_EVERY_S = 1.0  # how often idle connections past POOLED_IDLE_S are closed
# A request of another method that has no body says `Content-Length: 0`, as aiohttp's client does.
_BODILESS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
# The methods sent again on another connection when a pooled one dies under them (RFC 9112
# section 9.3.1; aiohttp.client.IDEMPOTENT_METHODS).
SENT_AGAIN = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})


class SendCount:
    """How many times one request was sent again on another connection."""

    __slots__ = ("retries",)

    def __init__(self) -> None:
        self.retries = 0


class UpstreamResponse:
    """An answer's status and head, its body as aiohttp's StreamReader (`content`), and the
    connection under it, back to the pool when the body has ended, closed by `close()` before."""

    __slots__ = ("_drop", "_release", "_writer", "content", "done", "headers", "protocol", "raw_headers", "reason",
                 "status")

    def __init__(self, protocol: Connection, status: int, reason: str, headers: CIMultiDictProxy[str],
                 content: StreamReader, writer: asyncio.Task[None] | None, *,
                 release: Callable[[Connection], None], drop: Callable[[Connection], None],
                 raw_headers: RawHeaders = ()) -> None:
        self._release = release  # the pool's, given: the answer never reaches back into its pool
        self._drop = drop
        self._writer = writer
        self.protocol = protocol
        self.status = status
        self.reason = reason
        self.headers = headers
        self.raw_headers = raw_headers  # the fields as they came (`headers` names those aiohttp knows its way)
        self.content = content
        self.done = False
        content.on_eof(self._body_ended)

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("Content-Length")
        return int(value) if value is not None and value.isdigit() else None

    def _body_ended(self) -> None:
        if self.done:
            return
        self.done = True
        if self._writer is not None and not self._writer.done():  # answered before the body was sent
            self._writer.cancel()
            self._drop(self.protocol)
            return
        self._release(self.protocol)

    def close(self) -> None:
        """Close the connection unless the body ended and it went back to the pool (idempotent)."""
        if self.done:
            return
        self.done = True
        if self._writer is not None:
            self._writer.cancel()
        self._drop(self.protocol)

    @property
    def closed(self) -> asyncio.Future[None] | None:
        """The future resolved when the connection closes (None: it has already)."""
        return self.protocol.closed


class UpstreamPool:
    """Keep-alive connections to the one upstream, oldest first; see the module's docstring."""

    def __init__(self, base: str, connect_timeout_s: float | None) -> None:
        self.stale_closed = 0  # pooled connections found closed, or quiet too long
        parts = urlsplit(base)
        url = URL(base)
        self.host = url.raw_host or ""
        self.port = url.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.authority = url.host_port_subcomponent or self.host
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        self.connect_timeout_s = connect_timeout_s or None
        self._idle: deque[Connection] = deque()  # oldest first
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    # --- sending ------------------------------------------------------------------------------
    async def send(self, method: str, target: str, headers: CIMultiDict[str], body: Outgoing,
                   count: SendCount, written: Callable[[], None] = lambda: None) -> UpstreamResponse:
        """Send one request and return its answer once the head has come; `count` counts each
        send again (see the module's docstring); `written()` is called each time the request was
        written, before its answer is awaited."""
        if body is None and method not in _BODILESS and "Content-Length" not in headers \
                and "Transfer-Encoding" not in headers:
            headers["Content-Length"] = "0"
        elif isinstance(body, memoryview):
            headers["Content-Length"] = str(len(body))
        chunked = body is not None and not isinstance(body, memoryview) and "Content-Length" not in headers
        if chunked:
            headers["Transfer-Encoding"] = "chunked"
        head = request_head(method, upstream_target(self.prefix, target), self.authority, headers)
        again = method in SENT_AGAIN and not chunked and (body is None or isinstance(body, memoryview))
        while True:
            protocol, pooled = await self._connection()
            try:
                return await self._exchange(protocol, method, head, body, chunked, written)
            except (ClientOSError, ServerDisconnectedError):
                # Sent again only when not one byte of its answer came: a begun answer is an answer.
                if not (again and pooled and protocol.received == 0):
                    raise
                again = False
                count.retries += 1

    async def _exchange(self, protocol: Connection, method: str, head: bytes, body: Outgoing,
                        chunked: bool, written: Callable[[], None]) -> UpstreamResponse:
        protocol.expect_answer(method == "HEAD")
        transport = protocol.transport
        assert transport is not None
        writer: asyncio.Task[None] | None = None
        if body is None:
            transport.write(head)
        elif isinstance(body, memoryview):
            if len(body) <= 65536:
                transport.write(head + body)
            else:
                transport.write(head)
                transport.write(body)
        else:
            transport.write(head)
            writer = asyncio.get_running_loop().create_task(protocol.send_body(body, chunked))
        try:
            written()
            while True:
                try:
                    message, payload = await protocol.read()
                except HttpProcessingError as exc:
                    raise InvalidResponse(str(exc.message)) from exc
                if message.code == 101:  # the proxy forwards no Upgrade: nobody asked to switch
                    raise InvalidResponse("an upgrade (101 Switching Protocols) the client did not ask for")
                if not 100 <= message.code <= 199:
                    break  # an interim 1xx (100, 102, 103) is not the answer, and is not relayed
        except BaseException:
            if writer is not None:
                writer.cancel()
            protocol.close()
            raise
        if message.should_close:
            protocol.force_close()
        return UpstreamResponse(protocol, message.code, message.reason, message.headers, payload, writer,
                                release=self.release, drop=self.drop, raw_headers=message.raw_headers)

    # --- the pool -----------------------------------------------------------------------------
    async def _connection(self) -> tuple[Connection, bool]:
        """A settled, live pooled connection (and True), or a fresh one (and False)."""
        protocol = self._take()
        if protocol is not None:
            return protocol, True
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, protocol = await loop.create_connection(
                    lambda: Connection(loop), self.host, self.port, ssl=self.ssl,
                    server_hostname=self.host if self.ssl is not None else None)
        except TimeoutError:
            raise
        except OSError as exc:
            raise UpstreamUnreachable(exc) from exc
        return protocol, False

    def _take(self) -> Connection | None:
        """The oldest pooled connection that is available; those still resting after a stream stay,
        in their order; those that are not available are closed."""
        idle = self._idle
        if not idle:
            return None
        now = time.monotonic()
        resting: list[Connection] = []
        taken = None
        while idle:
            protocol = idle.popleft()
            if not protocol.is_settled(now):
                resting.append(protocol)
                continue
            if protocol.is_available(now, POOLED_IDLE_S):
                taken = protocol
                taken.taken()
                break
            self.stale_closed += 1
            protocol.close()
        if resting:  # back at the head of the pool, in their order
            idle.extendleft(reversed(resting))
        return taken

    def streamed(self, response: UpstreamResponse) -> None:
        """This answer has no length (a stream): its connection rests before it is used again."""
        response.protocol.streamed = True

    def drop(self, protocol: Connection) -> None:
        """Close a connection that will not go back to the pool."""
        protocol.close()

    def release(self, protocol: Connection) -> None:
        """A connection whose answer has ended: to the pool, or closed when it cannot carry another."""
        if self._closed or not protocol.can_carry_another:
            self.drop(protocol)
            return
        protocol.released(time.monotonic())
        self._idle.append(protocol)
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(SWEEP_EVERY_S, self._close_idle)

    def _close_idle(self) -> None:
        """Close the pooled connections that have expired (idle past POOLED_IDLE_S, or closed)."""
        self._sweep = None
        now = time.monotonic()
        kept: deque[Connection] = deque()
        for protocol in self._idle:
            if protocol.has_expired(now, POOLED_IDLE_S):
                protocol.close()
            else:
                kept.append(protocol)
        self._idle = kept
        if kept:
            self._sweep = asyncio.get_running_loop().call_later(SWEEP_EVERY_S, self._close_idle)

    async def close(self) -> None:
        """Close every pooled connection; connections still answering close when their answer ends."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        while self._idle:
            self._idle.popleft().close()
