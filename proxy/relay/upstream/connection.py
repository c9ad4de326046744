"""One HTTP/1.1 connection to the upstream, and everything its pool needs to know of it.

The connection reads answers with aiohttp's own response protocol and parser (llhttp): the same
framing, limits and errors as aiohttp's client. It keeps its own state, as httpcore's connection
does, and answers the pool's questions itself: whether it can carry a request now
(`is_available`), whether it should be closed (`has_expired`), how long the server has been
quiet on it (`quiet_for`, the kernel's clock, read when the connection goes back to its pool: the
taking of it, on the way to a first token, makes no syscall for it; read through libc on the
descriptor, as uvloop's socket stand-in would make a socket object for each reading).

That look cannot see a close still on its way. llama-server closes its connection after every
streamed response despite `Keep-Alive`, a few milliseconds after the last byte: a request written
in between would be lost. So a connection that carried a streamed answer rests SETTLE_S after its
release before it is available again.
"""

from __future__ import annotations

import asyncio
import ctypes
import select
import socket
import struct
from collections.abc import AsyncIterator, Callable
from enum import Enum
from typing import Any, Protocol

from aiohttp.client_exceptions import ClientOSError
from aiohttp.client_proto import ResponseHandler
from aiohttp.helpers import EMPTY_BODY_STATUS_CODES
from aiohttp.streams import EMPTY_PAYLOAD

from proxy.relay.http1 import chunk, last_chunk

# llama-server's close came 1-2 ms after the last byte of a stream on an idle machine (a request
# sent into that window got no answer in 11 of 100 tries); a wide margin for a loaded one.
SETTLE_S = 0.25
READ_BUFSIZE = 1 << 16  # aiohttp's client default

# struct tcp_info (linux/tcp.h): tcpi_last_data_recv, milliseconds since the kernel last received
# data on the socket, is the eighth __u32 after the eight one-byte fields.
_TCP_INFO = getattr(socket, "TCP_INFO", None)
_LAST_DATA_RECV = struct.Struct("=I")
_LAST_DATA_RECV_AT = 52


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


_INFO_BYTES = _LAST_DATA_RECV_AT + 4


def _libc_getsockopt() -> Any:
    """libc's getsockopt(2), called on a descriptor (None where it cannot be loaded)."""
    try:
        call = ctypes.CDLL(None, use_errno=True).getsockopt
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32))
    call.restype = ctypes.c_int
    return call


_getsockopt = _libc_getsockopt() if _TCP_INFO is not None else None


def quiet_for(fd: int) -> float | None:
    """Seconds since the server's last byte reached this machine's kernel on the socket `fd`, or
    None where the kernel does not say (not Linux, or the call failed).

    The pool's own clock starts when the response's end was parsed: on a busy event loop, or after
    a slow client held the upstream's reads back, that can be long after the server sent it. The
    server's keep-alive timer (uvicorn's 5 s in vLLM) started at its last byte, and so does this
    figure. One getsockopt(2) through libc: no socket object is made for it (uvloop's stand-in
    makes one per call: side by side, B/A 0.992 over 8 rounds, docs/overhead.md)."""
    if _TCP_INFO is None:
        return None
    info: Any
    if _getsockopt is not None:
        info = (ctypes.c_char * _INFO_BYTES)()
        size = ctypes.c_uint32(_INFO_BYTES)
        if _getsockopt(fd, socket.IPPROTO_TCP, _TCP_INFO, info, ctypes.byref(size)) != 0 or size.value < _INFO_BYTES:
            return None
    else:
        try:
            sock = socket.socket(fileno=fd)
        except (OSError, ValueError):  # (not a socket; a negative descriptor)
            return None
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _INFO_BYTES)
        except OSError:
            return None
        finally:
            sock.detach()  # (the descriptor stays its owner's)
        if len(info) < _INFO_BYTES:
            return None
    return float(_LAST_DATA_RECV.unpack_from(info, _LAST_DATA_RECV_AT)[0]) / 1000.0


def readable(fd: int) -> bool:
    """The descriptor has something to read (data, a FIN, an error) right now."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))


class Taker(Protocol):
    """Who takes a chunked body past the parser: `(read)` per read, `(b"", True)` once the
    connection is lost."""

    def __call__(self, data: bytes, lost: bool = False) -> None: ...


class _TakenReads:
    """The transport's protocol while the relay takes a chunked body: its reads go straight to the
    taker (the loop calls it as `data_received`: at one event per read, one Python call less each
    than through the connection), all else to the connection, whose protocol it stays."""

    __slots__ = ("_connection", "data_received")

    def __init__(self, connection: Connection, taker: Taker) -> None:
        self._connection = connection
        self.data_received = taker

    def eof_received(self) -> None:  # (None: the transport closes, as for the connection)
        self._connection.eof_received()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._connection.connection_lost(exc)

    def pause_writing(self) -> None:
        self._connection.pause_writing()

    def resume_writing(self) -> None:
        self._connection.resume_writing()


class ConnectionState(Enum):
    """Where a connection is in its life, as its pool sees it (httpcore's HTTPConnectionState)."""

    TAKEN = "taken"  # handed out for a request that is about to be written (a new one starts here)
    ACTIVE = "active"  # its request written, its answer being read
    IDLE = "idle"  # its answer ended: in the pool, for the next request once settled
    CLOSED = "closed"  # closed by either side: never used again


class Connection(ResponseHandler):
    """aiohttp's response protocol, with the state of its connection (`state`): the socket's descriptor (for the
    liveness look), which kind of answer its parser reads, the bytes of the current answer, and
    when it was released and may carry the next request."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.state = ConnectionState.TAKEN
        self.fd = -1  # the socket's descriptor, once connected (the liveness look, the kernel's clock)
        self.parses_head: bool | None = None  # None: no parser yet
        self.received = 0  # bytes of the current answer that have come: a request is sent again only at 0
        self.streamed = False  # the current answer had no length: the server may close after it
        self.released_at = 0.0  # monotonic, when its last answer ended
        self.last_heard: float | None = None  # monotonic, when the kernel last received from the server
        self._last: tuple[bytes, bytes] = (b"", b"")  # the last two reads, as they came (a chunked end)
        # Called after each read was parsed (False) and once the connection is lost (True): the
        # relay takes the body where it arrives (relay.body_pump).
        self.on_data: Callable[[bool], None] | None = None
        # A chunked body bypasses the parser (relay.chunked frames it as it passes): the head is
        # parsed alone, what follows is held until the relay takes it, then handed over read by read.
        self._split = False  # the head of the current answer is still to be cut from its body
        self._head_end = b""  # the last bytes of the head read so far, where its end may straddle reads
        self.held: bytearray | None = None  # a chunked body the relay has not taken yet
        self.on_raw: Taker | None = None  # the relay's taker of a chunked body
        self._taken: _TakenReads | None = None  # the transport's protocol meanwhile

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        self.fd = sock.fileno() if sock is not None else -1

    def data_received(self, data: bytes) -> None:
        on_raw = self.on_raw
        if on_raw is not None:  # the relay's, for a chunked body: past the parser, at once
            if data:
                on_raw(data, False)
            return
        if data:  # aiohttp calls it with nothing to resume a paused read
            self.received += len(data)
            self._last = (self._last[1], data)
            held = self.held
            if held is not None:
                held += data
                if len(held) >= READ_BUFSIZE and self.transport is not None:
                    self.transport.pause_reading()  # resumed when the relay takes it
                return
            if self._split:
                self._cut_head(data)
                return
        self._parse(data)

    def _parse(self, data: bytes) -> None:
        super().data_received(data)
        on_data = self.on_data
        if on_data is not None:
            on_data(False)

    def _cut_head(self, data: bytes) -> None:
        """Parse the answer's head alone; when it heads a chunked body, hold what follows it."""
        seen = self._head_end + data
        at = seen.find(b"\r\n\r\n")
        if at < 0:
            self._head_end = seen[-3:]
            self._parse(data)
            return
        cut = at + 4 - len(self._head_end)
        self._head_end = b""
        queued = len(self)
        self._parse(data[:cut])
        rest = data[cut:]
        if len(self) > queued and self.exception() is None:
            (message, payload), _ = self._buffer[-1]
            if 100 <= message.code <= 199:  # an interim answer: the final head follows
                if rest:
                    self._cut_head(rest)
                return
            if (message.chunked and payload is not EMPTY_PAYLOAD and payload is self._payload
                    and not payload.total_bytes and message.code not in EMPTY_BODY_STATUS_CODES):
                self._split = False
                self.held = bytearray(rest)
                return
        self._split = False
        if rest:
            self._parse(rest)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.state = ConnectionState.CLOSED
        super().connection_lost(exc)
        on_data = self.on_data
        if on_data is not None:
            on_data(True)
        on_raw = self.on_raw
        if on_raw is not None:
            on_raw(b"", True)

    # --- a chunked body, taken past the parser ---------------------------------------------------
    @property
    def raw_body(self) -> bool:
        """The current answer's body is chunked and held for the relay to take (`take_body`)."""
        return self.held is not None

    def take_body(self, taker: Taker) -> None:
        """From now on every read of the body goes to `taker(read)`, what was held first;
        `taker(b"", True)` once the connection is lost."""
        held, self.held = self.held, None
        self.on_raw = taker
        transport = self.transport
        if transport is not None and not self._connection_lost_called:
            taken = _TakenReads(self, taker)
            try:
                transport.set_protocol(taken)  # type: ignore[arg-type]
                self._taken = taken
            except NotImplementedError:  # (a transport without it: the reads come through data_received)
                pass
        self.resume_body()
        if held:
            taker(bytes(held), False)
        if self._connection_lost_called and self.on_raw is taker:
            taker(b"", True)

    def stop_taking(self, taker: Taker | None = None) -> None:
        """No more reads to the taker (`taker`: only if it is still the one); the connection is
        the transport's protocol again (idempotent)."""
        if taker is not None and self.on_raw != taker:
            return
        self.on_raw = None
        taken, self._taken = self._taken, None
        transport = self.transport
        if taken is not None and transport is not None and transport.get_protocol() is taken:  # type: ignore[comparison-overlap]
            transport.set_protocol(self)

    def pause_body(self) -> None:
        """The client takes no more for now: stop reading the upstream."""
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_body(self) -> None:
        if self.transport is not None and not self._reading_paused:
            self.transport.resume_reading()

    def body_read_whole(self, extra: bool) -> None:
        """The relay read the chunked body to its end (`extra`: bytes followed it, so the connection
        carries nothing more). The parser, left inside a body it never saw, is made anew; the
        answer's body reader ends, which gives the connection back to its pool."""
        self.stop_taking()
        self.held = None
        if extra:
            self.force_close()
        payload, self._payload = self._payload, None
        self.parses_head = False
        self.set_response_params(skip_payload=False, read_until_eof=True, auto_decompress=False,
                                 read_bufsize=READ_BUFSIZE)
        if payload is not None:
            payload.feed_eof()

    def resume_reading(self, resume_parser: bool = True) -> None:
        """aiohttp's body reader asks this after every read it hands out, paused or not: when nothing
        was paused there is nothing to resume, and the parse of nothing and the transport call it
        would cost per read are skipped."""
        if self._reading_paused:
            super().resume_reading(resume_parser)

    def raw_tail(self) -> bytes:
        """The last bytes that came, as they came: the end of a chunked body, with its trailer section."""
        return self._last[0] + self._last[1]

    def expect_answer(self, head: bool) -> None:
        """Ready the parser for the answer to the request about to be written. aiohttp makes a
        new parser per request; llhttp reads one answer after another on a keep-alive
        connection, so one is made again only when the kind of answer changes."""
        self.state = ConnectionState.ACTIVE
        self.received = 0
        self.streamed = False
        self._last = (b"", b"")
        self.on_data = None
        self.stop_taking()
        self.held = None
        self._split = not head
        self._head_end = b""
        if self.parses_head is head:
            return
        self.parses_head = head
        self.set_response_params(skip_payload=head, read_until_eof=True, auto_decompress=False,
                                 read_bufsize=READ_BUFSIZE)

    # --- the pool's questions ------------------------------------------------------------------
    def close(self) -> None:
        self.state = ConnectionState.CLOSED
        super().close()

    def taken(self) -> None:
        """Handed out by the pool for the next request."""
        self.state = ConnectionState.TAKEN

    def released(self, now: float) -> None:
        """Its answer ended at `now`: idle, in the pool. When the server's last byte reached the
        kernel is read now, once (`quiet_for`): a byte after it is one of no request, which
        `is_available` sees, so the figure holds for as long as the connection can be taken."""
        self.state = ConnectionState.IDLE
        self.released_at = now
        quiet = quiet_for(self.fd) if self.fd >= 0 else None
        self.last_heard = None if quiet is None else now - quiet

    @property
    def can_carry_another(self) -> bool:
        """Its answer ended cleanly and the server keeps it open: it may go back to the pool."""
        return self.state is not ConnectionState.CLOSED and not self.should_close and self.is_connected()

    def is_settled(self, now: float) -> bool:
        """Past the rest after a stream (SETTLE_S from its release; none after an answer with a
        length). `streamed` may be said before or after the release: a short stream's end is often
        parsed before the relay has read its head."""
        return now >= self.released_at + (SETTLE_S if self.streamed else 0.0)

    def has_expired(self, now: float, max_idle_s: float) -> bool:
        """Closed, or idle past `max_idle_s` by the pool's clock: to be closed (no syscall)."""
        return (self.state is ConnectionState.CLOSED or not self.is_connected()
                or now - self.released_at > max_idle_s)

    def is_available(self, now: float, max_idle_s: float) -> bool:
        """Settled, open, and neither closed by the server nor quiet past `max_idle_s` by the kernel.

        Closed: an idle HTTP/1.1 connection has nothing to read, so a readable socket means a FIN, a
        reset, or bytes that belong to no request. One poll(2) with no wait, on its own descriptor.
        """
        fd = self.fd
        if (self.state is not ConnectionState.IDLE or fd < 0 or self.should_close  # (bytes of no request)
                or not self.is_settled(now) or self.has_expired(now, max_idle_s)):
            return False
        last_heard = self.last_heard
        return (last_heard is None or now - last_heard <= max_idle_s) and not readable(fd)

    # --- sending ---------------------------------------------------------------------------------
    async def send_body(self, pieces: AsyncIterator[bytes | bytearray | memoryview], chunked: bool) -> None:
        """Send a body as it comes (chunked when it has no length), waiting while the socket is full.
        A failure ends the exchange: the answer's read raises it."""
        transport = self.transport
        try:
            async for piece in pieces:
                if not piece or transport is None or transport.is_closing():
                    continue
                transport.write(chunk(piece) if chunked else piece)
                await self._drain_helper()
            if chunked and transport is not None and not transport.is_closing():
                transport.write(last_chunk())
        except Exception as exc:  # the client's body broke off, or the upstream's connection
            self.set_exception(ClientOSError(f"the request body could not be sent on: {exc!r}"[:300]))
            self.close()
