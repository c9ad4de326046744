"""A raw asyncio HTTP/1.1 upstream that misbehaves on request: each request's `X-Fault` header
picks what it does wrong; without one it streams a healthy, byte-exact OpenAI SSE answer.

Raw sockets, because aiohttp's own server cannot send invalid HTTP, a truncated chunked body
or a megabyte header. It answers one request per connection and then closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from dataclasses import dataclass, field

from tests.support.wire import openai_stream

HEALTHY_CHUNKS = openai_stream(20)
HEALTHY_BODY = b"".join(HEALTHY_CHUNKS)
MIB = 1 << 20
BIG_BODY_SIZE = 100 * MIB
SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: close\r\n\r\n")


def chunk(data: bytes) -> bytes:
    """One chunk of the chunked transfer coding."""
    return b"%x\r\n" % len(data) + data + b"\r\n"


@dataclass
class Received:
    head: bytes
    headers: dict[str, str]
    body: bytes
    complete: bool  # the whole declared body arrived


@dataclass
class FaultyUpstream:
    received: list[Received] = field(default_factory=list)
    disconnects: int = 0  # connections the proxy closed while we were still answering
    release: asyncio.Event = field(default_factory=asyncio.Event)  # ends every hang
    server: asyncio.Server | None = None
    body_timeout_s: float = 0.3

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", port, reuse_address=True)

    async def close(self) -> None:
        self.release.set()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _read_request(self, reader: asyncio.StreamReader) -> Received:
        head = await reader.readuntil(b"\r\n\r\n")
        headers: dict[str, str] = {}
        for line in head.decode("latin-1").split("\r\n")[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        timeout = self.body_timeout_s if headers.get("x-fault") == "want_body_fast" else None
        body = bytearray()
        complete = True
        try:
            async with asyncio.timeout(timeout):
                if "content-length" in headers:
                    body += await reader.readexactly(int(headers["content-length"]))
                elif "chunked" in headers.get("transfer-encoding", "").lower():
                    while True:
                        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                        body += await reader.readexactly(size + 2)  # the data and its CRLF
                        del body[-2:]
                        if size == 0:  # no trailers are sent to us: that CRLF ended the body
                            break
        except TimeoutError:
            complete = False
        return Received(head, headers, bytes(body), complete)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await self._read_request(reader)
            self.received.append(request)
            fault = request.headers.get("x-fault", "healthy")
            await getattr(self, "_" + fault)(request, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            self.disconnects += 1
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _hang(self, seconds: float = 30.0) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.release.wait(), seconds)

    # --- behaviours, by X-Fault value --------------------------------------------------------
    async def _healthy(self, request: Received, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD)
        for piece in HEALTHY_CHUNKS:
            writer.write(chunk(piece))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def _reset(self, request: Received, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Close with an RST (SO_LINGER 0) instead of answering."""
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async def _no_answer(self, request: Received, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        """Read the request, never answer (until released)."""
        await self._hang()

    async def _headers_then_hang(self, request: Received, reader: asyncio.StreamReader,
                                 writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + chunk(HEALTHY_CHUNKS[0]))
        await writer.drain()
        await self._hang()

    async def _truncated_chunked(self, request: Received, reader: asyncio.StreamReader,
                                 writer: asyncio.StreamWriter) -> None:
        """Two whole chunks, then a chunk that announces 1024 bytes, sends 10 and closes."""
        writer.write(SSE_HEAD + chunk(HEALTHY_CHUNKS[0]) + chunk(HEALTHY_CHUNKS[1]) + b"400\r\n" + b"data: {\"ch")
        await writer.drain()

    async def _bad_chunk_size(self, request: Received, reader: asyncio.StreamReader,
                              writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + chunk(HEALTHY_CHUNKS[0]))
        await writer.drain()
        await asyncio.sleep(0.2)  # the head and first event have gone on to the client
        writer.write(b"zz\r\nnot a chunk\r\n")
        await writer.drain()
        await self._hang(2.0)

    async def _invalid_http(self, request: Received, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        writer.write(b"SURPRISE this is not HTTP\r\n\r\n")
        await writer.drain()

    async def _huge_header(self, request: Received, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-Huge: " + b"h" * MIB + b"\r\n\r\n")
        await writer.drain()

    async def _big_body(self, request: Received, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A 100 MiB non-streaming JSON body with a Content-Length."""
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n" % BIG_BODY_SIZE)
        block = big_body_block()
        for _ in range(BIG_BODY_SIZE // len(block)):
            writer.write(block)
            await writer.drain()

    async def _want_body_fast(self, request: Received, reader: asyncio.StreamReader,
                              writer: asyncio.StreamWriter) -> None:
        """408 when the body did not arrive within `body_timeout_s` of the headers."""
        if request.complete:
            await self._healthy(request, reader, writer)
            return
        body = b'{"error":"request body too slow"}'
        writer.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n%s" % (len(body), body))
        await writer.drain()


def big_body_block() -> bytes:
    """1 MiB of the big body (it repeats): JSON-looking, never valid as a whole."""
    return (b'{"filler":"' + b"z" * (MIB - 13) + b'"}')[:MIB]
