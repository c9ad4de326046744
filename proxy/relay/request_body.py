"""A client's request body on its way upstream: held once to be read, or streamed on unread.

The proxy reads a body before it connects upstream, so that it knows what was asked. A body that
fits the parse cap and the process-wide bound on bytes held for parsing (`--parse-bytes`) is held in
one bytearray, read for the record, and sent from that same buffer (in slices past SEND_SLICE, so a
big one is never copied whole). A body past either limit is streamed on as it arrives, with the
client's own Content-Length, and the record says why it was not read.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from aiohttp import web
from aiohttp.http import HttpVersion11
from multidict import CIMultiDict

from proxy.wire.parse_bytes import ParseBytes

SEND_SLICE = 1 << 20  # bytes per write of a held body

Outgoing = memoryview | AsyncIterator[bytes | bytearray | memoryview] | None


class RequestBody:
    """One request's body: `held` (read whole), or unread with `note` saying why."""

    __slots__ = ("_parse_bytes", "_request", "_reserved", "held", "note", "unread")

    def __init__(self, request: web.BaseRequest, parse_bytes: ParseBytes) -> None:
        self._request = request
        self._parse_bytes = parse_bytes
        self._reserved = 0  # bytes of `held` counted in the bytes held for parsing
        self.held: bytearray | None = None  # the whole body, when it was read
        self.note: str | None = None  # why it was not read
        self.unread: tuple[bytearray, bytes] | None = None  # what was taken before giving up

    async def read(self, cap: int) -> None:
        """Take the body until its end, or until the cap or `--parse-bytes` stops it (then it streams).

        A body of declared length takes its share of the bytes held whole before it is read: many big
        bodies at once are then read first come, first served, rather than each taking part of
        the bound and all failing. A chunked one takes its share piece by piece.
        """
        request = self._request
        if not request.body_exists:
            return
        _continue(request)
        declared = request.content_length
        if declared is not None:
            if declared > cap:
                self._pass_on(bytearray(), b"", _over_cap(cap))
                return
            if not self._parse_bytes.reserve(declared):
                self._pass_on(bytearray(), b"", _PARSE_BYTES_RAN_OUT)
                return
            self._reserved = declared
        head = bytearray()
        while True:
            chunk = await request.content.readany()
            if not chunk:
                self.held = head
                return
            if declared is None:
                if len(head) + len(chunk) > cap:
                    self._pass_on(head, chunk, _over_cap(cap))
                    return
                if not self._parse_bytes.reserve(len(chunk)):
                    self._pass_on(head, chunk, _PARSE_BYTES_RAN_OUT)
                    return
                self._reserved += len(chunk)
            head += chunk

    def _pass_on(self, head: bytearray, chunk: bytes, note: str) -> None:
        self.unread = (head, chunk)
        self.note = note

    def outgoing(self, headers: CIMultiDict[str]) -> Outgoing:
        """What the upstream pool sends. A big or streamed body gets the Content-Length the client
        declared (the pool would chunk an iterator), set in `headers` here."""
        if self.held is not None:
            if len(self.held) <= SEND_SLICE:
                return memoryview(self.held)
            headers["Content-Length"] = str(len(self.held))
            return _slices(self.held)
        if self.unread is not None:
            declared = self._request.content_length
            if declared is not None and "chunked" not in self._request.headers.get("Transfer-Encoding", "").lower():
                headers["Content-Length"] = str(declared)
            return self._stream(*self.unread)
        return None

    async def _stream(self, head: bytearray, chunk: bytes) -> AsyncIterator[bytes | bytearray | memoryview]:
        async for piece in _slices(head, self.release):
            yield piece
        if chunk:
            yield chunk
        async for rest in self._request.content.iter_any():
            yield rest

    def release(self) -> None:
        """Give the held bytes back (idempotent)."""
        self._parse_bytes.release(self._reserved)
        self._reserved = 0


CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def _continue(request: web.BaseRequest) -> None:
    """An HTTP/1.1 client that expects `100-continue` waits for it before it sends its body (curl for
    a second, others longer): the proxy, which reads every body, asks for it at once, unless some of
    it has come already (RFC 9110 section 10.1.1; an HTTP/1.0 client's expectation is ignored). The
    field itself is not sent on (`http1.REQUEST_SKIP`): the upstream gets the body with the request."""
    if (request.version != HttpVersion11 or request.content.total_bytes
            or request.headers.get("Expect", "").strip().lower() != "100-continue"):
        return
    transport = request.transport
    if transport is not None and not transport.is_closing():
        transport.write(CONTINUE)


_PARSE_BYTES_RAN_OUT = "the process-wide bytes held for parsing (--parse-bytes) ran out: request body not parsed"


def _over_cap(cap: int) -> str:
    return f"request body over the {cap}-byte parse cap: not parsed"


async def _slices(body: bytearray, then: Callable[[], None] | None = None) -> AsyncIterator[memoryview]:
    view = memoryview(body)
    for start in range(0, len(view), SEND_SLICE):
        yield view[start:start + SEND_SLICE]
    if then is not None:
        then()
