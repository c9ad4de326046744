"""A TCP relay that keeps a copy of every byte the upstream sends: the witness for byte-identity.

Put between the proxy and llama-server, it shows what the server really sent, so a test can
compare it with what the proxy's client received. It relays, it never parses or changes.
"""

from __future__ import annotations

import asyncio
import contextlib


class ByteTee:
    """Relays 127.0.0.1:<port> to an upstream and records, per connection, the upstream's bytes."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self._upstream = (upstream_host, upstream_port)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.from_upstream: list[bytearray] = []  # one buffer per accepted connection, in order

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        seen = bytearray()
        self.from_upstream.append(seen)
        up_r, up_w = await asyncio.open_connection(*self._upstream)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, keep: bytearray | None) -> None:
            try:
                while chunk := await src.read(65536):
                    if keep is not None:
                        keep += chunk
                    dst.write(chunk)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    dst.close()

        tasks = [asyncio.create_task(pump(client_r, up_w, None)), asyncio.create_task(pump(up_r, client_w, seen))]
        self._tasks.update(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.difference_update(tasks)


def first_http_response(raw: bytes) -> tuple[bytes, dict[str, str], bytes]:
    """Split the first HTTP/1.1 response in `raw` into status line, headers and body (de-chunked).

    Transfer framing (chunk sizes, Content-Length) is hop-by-hop: a proxy may legitimately
    re-frame; the body inside it is what must be identical.
    """
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        raise ValueError("no complete HTTP response head")
    status_line, *header_lines = head.split(b"\r\n")
    headers: dict[str, str] = {}
    for line in header_lines:
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while True:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            body += rest[:size]
            rest = rest[size + 2 :]  # the chunk data and its CRLF
        return status_line, headers, bytes(body)
    length = int(headers.get("content-length", len(rest)))
    return status_line, headers, rest[:length]
