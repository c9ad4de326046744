"""Raw HTTP/1.1 on both sides of the proxy, for tests where the point is the exact bytes: a
server that keeps each request's head and body as they came, and a client that sends bytes and
reads the answer to its end."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

ANSWER = b'{"ok":true}'
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER)


@dataclass
class RawUpstream:
    """A raw HTTP/1.1 server: it keeps each request's head and body as bytes, and answers each
    with `answer` (one keep-alive connection may carry many)."""

    answer: bytes = OK
    heads: list[bytes] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    connections: int = 0
    closed: int = 0
    server: asyncio.Server | None = None

    def url(self, scheme: str = "http") -> str:
        assert self.server is not None
        return f"{scheme}://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                fields = {line.partition(b":")[0].strip().lower(): line.partition(b":")[2].strip()
                          for line in head.split(b"\r\n")[1:] if line}
                if fields.get(b"transfer-encoding") == b"chunked":
                    body = b""
                    while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
                        body += (await reader.readexactly(size + 2))[:-2]
                    await reader.readuntil(b"\r\n")
                else:
                    body = await reader.readexactly(int(fields.get(b"content-length", b"0")))
                self.bodies.append(body)
                writer.write(self.answer)
                await writer.drain()
        self.closed += 1
        writer.close()


async def exchange(url: str, request: bytes) -> bytes:
    """Send raw request bytes to the proxy and read its answer to the end (it closes)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return answer


def head_lines(head: bytes) -> list[bytes]:
    return head.removesuffix(b"\r\n\r\n").split(b"\r\n")
