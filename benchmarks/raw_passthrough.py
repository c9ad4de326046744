"""The floor of a Python relay below aiohttp: raw asyncio protocols on uvloop, a pooled upstream, nothing else.

Each client connection reads a request head and its `Content-Length` body, sends them on a pooled
keep-alive connection to the upstream, and writes every read of the answer to the client as it
came, in the callback that received it; the answer's end is found by its framing (a length, or
chunked read with the proxy's own `relay.chunked`). No record, no parsing of events, no metrics,
no log. What `overhead.py --targets direct,nginx,proxy,raw` measures beside the proxy: the cost
of Python and the event loop per event, without aiohttp's server and without the diagnosis. Not a
product: no limits, no timeouts, no chunked requests, no pipelining beyond one request at a time.

    python benchmarks/raw_passthrough.py --upstream http://127.0.0.1:11434 --listen 127.0.0.1:8080

With `--request-us`, `--head-us` and `--end-us` it models a relay that does more per answer: that many
microseconds of CPU (a busy wait) where a relay does its per-answer work, each in the callback it
belongs to, the way the proxy does it: before the request is written upstream, before the answer's
first bytes are written to the client, and at the answer's end before the client's next request on
the connection is read. `benchmarks/path_budget.py` measures what each placement costs the first token.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.relay.chunked import ChunkedBody
from proxy.relay.http1 import HOP_BY_HOP, transfer_codings

_HEAD_END = b"\r\n\r\n"
_DROPPED = frozenset(name.encode() for name in HOP_BY_HOP | {"host"})  # (the host is the upstream's)


class Work:
    """Seconds of busy CPU per answer at each place a relay does its per-answer work (none by default)."""

    request = 0.0  # before the request is written upstream
    head = 0.0  # before the answer's first bytes are written to the client
    end = 0.0  # at the answer's end, before the client's next request is read


def spin(seconds: float) -> None:
    """Hold the CPU (and the loop) for `seconds`, as code would."""
    if seconds:
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            pass


def _length(head: bytes) -> tuple[int | None, bool]:
    """(Content-Length, chunked) of a message head."""
    length, chunked = None, False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = "chunked" in transfer_codings(value.decode("latin-1"))
    return length, chunked


class Upstream(asyncio.Protocol):
    """One pooled connection to the upstream: the answer's bytes go to `client` as they come."""

    def __init__(self, pool: list[Upstream]) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.client: Client | None = None
        self.head = b""
        self.in_head = True
        self.framing: ChunkedBody | None = None
        self.left = 0  # body bytes still to come, for an answer with a length

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's TCPTransport is no asyncio.Transport)
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def start(self, client: Client, request: bytes) -> None:
        self.client, self.head, self.in_head, self.framing, self.left = client, b"", True, None, 0
        assert self.transport is not None
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is None or client.transport is None:
            return
        if self.in_head and not self.head:
            spin(Work.head)  # the per-answer work before its first bytes go out
        client.transport.write(data)  # as it came, at once
        if self.in_head:
            self.head += data
            end = self.head.find(_HEAD_END)
            if end < 0:
                return
            self.in_head = False
            length, chunked = _length(self.head[:end])
            data = self.head[end + 4:]
            self.framing = ChunkedBody() if chunked else None
            self.left = length or 0  # (a body up to the close is not relayed here)
        framing = self.framing
        if framing is not None:
            if data:
                framing.feed(data)
            if framing.done:
                self._ended()
            return
        self.left -= len(data)
        if self.left <= 0:
            self._ended()

    def _ended(self) -> None:
        spin(Work.end)  # the per-answer work at its end, before the client's next request is read
        client, self.client = self.client, None
        self.pool.append(self)
        if client is not None:
            client.answered()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self in self.pool:
            self.pool.remove(self)
        client, self.client = self.client, None
        if client is not None and client.transport is not None:
            client.transport.close()


class Client(asyncio.Protocol):
    """One client connection: a request at a time, its answer relayed before the next is read."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's TCPTransport is no asyncio.Transport)
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._next()

    def _next(self) -> None:
        if self.busy:
            return
        end = self.buffer.find(_HEAD_END)
        if end < 0:
            return
        head = self.buffer[:end]
        length = _length(head)[0] or 0
        if len(self.buffer) < end + 4 + length:
            return
        body, self.buffer = self.buffer[end + 4:end + 4 + length], self.buffer[end + 4 + length:]
        lines = [line for line in head.split(b"\r\n")[1:] if line.split(b":", 1)[0].strip().lower() not in _DROPPED]
        request = b"\r\n".join([head.split(b"\r\n", 1)[0], b"Host: " + self.relay.authority, *lines]) + _HEAD_END + body
        self.busy = True
        spin(Work.request)  # the per-answer work before the request goes upstream
        self.relay.send(self, request)

    def answered(self) -> None:
        self.busy = False
        self._next()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None


class Relay:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.authority = f"{host}:{port}".encode()
        self.pool: list[Upstream] = []

    def send(self, client: Client, request: bytes) -> None:
        if self.pool:
            self.pool.pop().start(client, request)
            return
        asyncio.get_running_loop().create_task(self._connect(client, request))

    async def _connect(self, client: Client, request: bytes) -> None:
        _, upstream = await asyncio.get_running_loop().create_connection(
            lambda: Upstream(self.pool), self.host, self.port)
        upstream.start(client, request)


async def serve(upstream: str, listen: str) -> None:
    host, _, port = upstream.split("//", 1)[-1].rstrip("/").rpartition(":")
    relay = Relay(host, int(port))
    listen_host, _, listen_port = listen.rpartition(":")
    server = await asyncio.get_running_loop().create_server(lambda: Client(relay), listen_host, int(listen_port),
                                                            backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--listen", required=True, help="HOST:PORT")
    for place, where in (("request", "before the request is written upstream"),
                         ("head", "before the answer's first bytes are written to the client"),
                         ("end", "at the answer's end, before the client's next request is read")):
        parser.add_argument(f"--{place}-us", type=float, default=0.0, help=f"busy microseconds per answer {where}")
    args, _ = parser.parse_known_args()  # the proxy's own flags are accepted and ignored
    Work.request, Work.head, Work.end = args.request_us / 1e6, args.head_us / 1e6, args.end_us / 1e6
    import uvloop

    uvloop.run(serve(args.upstream, args.listen))


if __name__ == "__main__":
    main()
