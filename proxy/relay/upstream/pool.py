"""The client side of the forwarding path: one pool of HTTP/1.1 connections to the upstream.

It writes each request head itself, in one write with a held body, and reads the answer with
aiohttp's own response protocol and parser (llhttp): the same framing, limits and errors as
aiohttp's client, without the generality of its ClientSession (cookies, redirects, proxies,
traces, a request object per send), which cost more CPU per request than the diagnosis.

Connections are pooled: a fresh one per request costs a connect and an accept on the critical
path of every first token. A pooled connection idles at most POOLED_IDLE_S, less than the
keep-alive timeouts of uvicorn (vLLM) and cpp-httplib (llama-server), 5 s each. A server may still
close one while it sits in the pool: before a pooled connection carries a request, the pool
looks whether the server has closed it, and opens a fresh one instead, so a request is never
written into a closed socket and never has to be sent twice.

Nor is the pool's clock the server's: a connection is released when the response's end has been
parsed, which on a busy loop can be long after the server sent it; the server's keep-alive timer
runs from its last byte. So a pooled connection is also passed over when the kernel says the
server's last byte came more than POOLED_IDLE_S ago (TCP_INFO's tcpi_last_data_recv, on Linux).

That look cannot see a close still on its way. llama-server closes its connection after every
streamed response despite `Keep-Alive`, a few milliseconds after the last byte: a request taken
from the pool in between (the next one of a client that asks right after an answer) would be
written into a socket the server is closing, and be lost. So a connection that carried a
streamed answer rests SETTLE_S in the pool before it is used again; a request in that time gets
another connection or a fresh one.

A request that dies on a pooled connection before one byte of its answer came is sent once more on
another connection when its method is idempotent (RFC 9112 section 9.3.1) and its body is held; a
POST never, so a server never generates twice.
"""

from __future__ import annotations

import asyncio
import select
import socket
import ssl
import struct
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

from aiohttp.client_exceptions import ClientOSError, ServerDisconnectedError
from aiohttp.client_proto import ResponseHandler
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.streams import StreamReader
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from proxy.relay.http1 import upstream_target
from proxy.relay.request_body import Outgoing

POOLED_IDLE_S = 3.0
# llama-server's close came 1-2 ms after the last byte of a stream on an idle machine (a request
# sent into that window got no answer in 11 of 100 tries); a wide margin for a loaded one.
SETTLE_S = 0.25
SWEEP_EVERY_S = 1.0  # how often idle connections past POOLED_IDLE_S are closed
READ_BUFSIZE = 1 << 16  # aiohttp's client default
# A request of another method that has no body says `Content-Length: 0`, as aiohttp's client does.
_BODILESS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
# The methods sent again on another connection when a pooled one dies under them (RFC 9112
# section 9.3.1; aiohttp.client.IDEMPOTENT_METHODS).
SENT_AGAIN = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})


class UpstreamUnreachable(Exception):
    """No connection to the upstream could be opened; `os_error` says why."""

    def __init__(self, os_error: OSError) -> None:
        super().__init__(str(os_error))
        self.os_error = os_error


class InvalidResponse(Exception):
    """The upstream's response head is not valid HTTP; `message` is the parser's."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Connection(ResponseHandler):
    """aiohttp's response protocol, with what the pool keeps of its connection: the socket (for
    the liveness look) and whether its parser reads answers to HEAD (bodiless) or to the rest."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.sock: Any = None
        self.parses_head: bool | None = None  # None: no parser yet
        self.received = 0  # bytes of the current answer that have come: a request is sent again only at 0
        self._last: tuple[bytes, bytes] = (b"", b"")  # the last two reads, as they came (a chunked end)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.sock = transport.get_extra_info("socket")

    def data_received(self, data: bytes) -> None:
        if data:  # aiohttp calls it with nothing to resume a paused read
            self.received += len(data)
            self._last = (self._last[1], data)
        super().data_received(data)

    def raw_tail(self) -> bytes:
        """The last bytes that came, as they came: the end of a chunked body, with its trailer section."""
        return self._last[0] + self._last[1]

    def expect_answer(self, head: bool) -> None:
        """Ready the parser for the answer to the request about to be written. aiohttp makes a
        new parser per request; llhttp reads one answer after another on a keep-alive
        connection, so one is made again only when the kind of answer changes."""
        self.received = 0
        self._last = (b"", b"")
        if self.parses_head is head:
            return
        self.parses_head = head
        self.set_response_params(skip_payload=head, read_until_eof=True, auto_decompress=False,
                                 read_bufsize=READ_BUFSIZE)


# struct tcp_info (linux/tcp.h): tcpi_last_data_recv, milliseconds since the kernel last received
# data on the socket, is the eighth __u32 after the eight one-byte fields.
_TCP_INFO = getattr(socket, "TCP_INFO", None)
_LAST_DATA_RECV = struct.Struct("=I")
_LAST_DATA_RECV_AT = 52


def quiet_for(sock: Any) -> float | None:
    """Seconds since the server's last byte reached this machine's kernel on `sock`, or None where
    the kernel does not say (not Linux).

    The pool's own clock starts when the response's end was parsed: on a busy event loop that can
    be long after the server sent it. The server's keep-alive timer (uvicorn's 5 s in vLLM)
    started at its last byte, and so does this figure."""
    if _TCP_INFO is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _LAST_DATA_RECV_AT + 4)
    except OSError:
        return None
    if len(info) < _LAST_DATA_RECV_AT + 4:
        return None
    return float(_LAST_DATA_RECV.unpack_from(info, _LAST_DATA_RECV_AT)[0]) / 1000.0


def readable(fd: int) -> bool:
    """The descriptor has something to read (data, a FIN, an error) right now."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))


def _reusable(protocol: Connection) -> bool:
    """Open, neither closed by the server nor quiet too long (`quiet_for`).

    Closed: an idle HTTP/1.1 connection has nothing to read, so a readable socket means a FIN, a
    reset, or bytes that belong to no request. One poll(2) with no wait, on its own descriptor.
    """
    sock = protocol.sock
    if sock is None or protocol.should_close or not protocol.is_connected():  # (should_close: bytes of no request)
        return False
    quiet = quiet_for(sock)
    return (quiet is None or quiet <= POOLED_IDLE_S) and not readable(sock.fileno())


class SendCount:
    """How many times one request was sent again on another connection."""

    __slots__ = ("retries",)

    def __init__(self) -> None:
        self.retries = 0


class UpstreamResponse:
    """An answer's status and head, its body as aiohttp's StreamReader (`content`), and the
    connection under it, back to the pool when the body has ended, closed by `close()` before."""

    __slots__ = ("_pool", "_writer", "content", "done", "headers", "protocol", "reason", "status")

    def __init__(self, pool: UpstreamPool, protocol: Connection, status: int, reason: str,
                 headers: CIMultiDictProxy[str], content: StreamReader, writer: asyncio.Task[None] | None) -> None:
        self._pool = pool
        self._writer = writer
        self.protocol = protocol
        self.status = status
        self.reason = reason
        self.headers = headers
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
            self._pool.drop(self.protocol)
            return
        self._pool.release(self.protocol)

    def close(self) -> None:
        """Close the connection unless the body ended and it went back to the pool (idempotent)."""
        if self.done:
            return
        self.done = True
        if self._writer is not None:
            self._writer.cancel()
        self._pool.drop(self.protocol)

    @property
    def closed(self) -> asyncio.Future[None] | None:
        """The future resolved when the connection closes (None: it has already)."""
        return self.protocol.closed


class UpstreamPool:
    """Keep-alive connections to the one upstream, oldest first; see the module's docstring."""

    stale_closed = 0  # pooled connections found closed, or quiet too long, process-wide

    def __init__(self, base: str, connect_timeout_s: float | None) -> None:
        parts = urlsplit(base)
        url = URL(base)
        self.host = url.raw_host or ""
        self.port = url.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.authority = url.host_port_subcomponent or self.host
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        self.connect_timeout_s = connect_timeout_s or None
        self._idle: deque[tuple[Connection, float]] = deque()
        self._streamed: set[Connection] = set()
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    # --- sending ------------------------------------------------------------------------------
    async def send(self, method: str, target: str, headers: CIMultiDict[str], body: Outgoing,
                   count: SendCount) -> UpstreamResponse:
        """Send one request and return its answer once the head has come; `count` counts each
        send again (see the module's docstring)."""
        if body is None and method not in _BODILESS and "Content-Length" not in headers \
                and "Transfer-Encoding" not in headers:
            headers["Content-Length"] = "0"
        elif isinstance(body, memoryview):
            headers["Content-Length"] = str(len(body))
        chunked = body is not None and not isinstance(body, memoryview) and "Content-Length" not in headers
        if chunked:
            headers["Transfer-Encoding"] = "chunked"
        head = _request_head(method, upstream_target(self.prefix, target), self.authority, headers)
        again = method in SENT_AGAIN and not chunked and (body is None or isinstance(body, memoryview))
        while True:
            protocol, pooled = await self._connection()
            try:
                return await self._exchange(protocol, method, head, body, chunked)
            except (ClientOSError, ServerDisconnectedError):
                # Sent again only when not one byte of its answer came: a begun answer is an answer.
                if not (again and pooled and protocol.received == 0):
                    raise
                again = False
                count.retries += 1

    async def _exchange(self, protocol: Connection, method: str, head: bytes, body: Outgoing,
                        chunked: bool) -> UpstreamResponse:
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
            writer = asyncio.get_running_loop().create_task(_write_body(protocol, body, chunked))
        try:
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
        return UpstreamResponse(self, protocol, message.code, message.reason, message.headers, payload, writer)

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
        idle = self._idle
        if not idle:
            return None
        now = time.monotonic()
        resting: list[tuple[Connection, float]] = []
        taken = None
        while idle:
            protocol, released = idle.popleft()
            if protocol in self._streamed and now - released < SETTLE_S:
                resting.append((protocol, released))
                continue
            self._streamed.discard(protocol)
            if _reusable(protocol):
                taken = protocol
                break
            UpstreamPool.stale_closed += 1
            protocol.close()
        if resting:  # back at the head of the pool, in their order
            idle.extendleft(reversed(resting))
        return taken

    def streamed(self, response: UpstreamResponse) -> None:
        """This answer has no length (a stream): its connection rests before it is used again."""
        self._streamed.add(response.protocol)

    def drop(self, protocol: Connection) -> None:
        """Close a connection that will not go back to the pool, and forget it."""
        self._streamed.discard(protocol)
        protocol.close()

    def release(self, protocol: Connection) -> None:
        """A connection whose answer has ended: to the pool, or closed when it cannot carry another."""
        if self._closed or protocol.should_close or not protocol.is_connected():
            self.drop(protocol)
            return
        self._idle.append((protocol, time.monotonic()))
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(SWEEP_EVERY_S, self._close_idle)

    def _close_idle(self) -> None:
        """Close the pooled connections idle longer than POOLED_IDLE_S, or closed meanwhile."""
        self._sweep = None
        now = time.monotonic()
        kept: deque[tuple[Connection, float]] = deque()
        for protocol, released in self._idle:
            if now - released <= POOLED_IDLE_S and protocol.is_connected():
                kept.append((protocol, released))
            else:
                self._streamed.discard(protocol)
                protocol.close()
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
            self._idle.popleft()[0].close()
        self._streamed.clear()


def _request_head(method: str, target: str, authority: str, headers: CIMultiDict[str]) -> bytes:
    """The request line and header block, as they go on the wire: `Host` first, then the rest in
    the client's order. Values came through aiohttp's server parser (no CR or LF); bytes that are
    not UTF-8 pass as they came (surrogateescape)."""
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {authority}\r\n"]
    lines.extend(f"{name}: {value}\r\n" for name, value in headers.items())
    lines.append("\r\n")
    return "".join(lines).encode("utf-8", "surrogateescape")


async def _write_body(protocol: Connection, pieces: AsyncIterator[bytes | bytearray | memoryview],
                      chunked: bool) -> None:
    """Send a body as it comes (chunked when it has no length), waiting while the socket is full.
    A failure ends the exchange: the answer's read raises it."""
    transport = protocol.transport
    try:
        async for piece in pieces:
            if not piece or transport is None or transport.is_closing():
                continue
            if chunked:
                transport.write(b"%x\r\n" % len(piece) + bytes(piece) + b"\r\n")
            else:
                transport.write(piece)
            await protocol._drain_helper()
        if chunked and transport is not None and not transport.is_closing():
            transport.write(b"0\r\n\r\n")
    except Exception as exc:  # the client's body broke off, or the upstream's connection
        protocol.set_exception(ClientOSError(f"the request body could not be sent on: {exc!r}"[:300]))
        protocol.close()
