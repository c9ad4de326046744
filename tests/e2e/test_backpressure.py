"""Backpressure: a client that reads slowly slows the upstream down to its pace; the proxy
never holds the stream in memory.

The upstream here is a raw asyncio server that writes a 200 MiB event stream as fast as its
socket takes it and notes how much the socket accepted and how long each drain waited.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from proxy.record import ResponseRecord
from proxy.serve.app import RunningProxy
from tests.e2e.load.resources import rss_bytes, settle_memory
from tests.support.proxies import ProxyFactory

MIB = 1 << 20
TOTAL = 200 * MIB
EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * (64 * 1024 - 64)
EVENT = EVENT + b'"},"finish_reason":null}]}\n\n'
RSS_GROWTH_LIMIT = 64 * MIB

pytestmark = pytest.mark.timeout(180)


class FloodUpstream:
    """Answers one request with `TOTAL` bytes of SSE (chunked), as fast as the socket drains."""

    def __init__(self) -> None:
        self.sent = 0  # body bytes the socket has accepted
        self.drain_wait_max = 0.0  # the longest one write waited for the socket
        self.draining_since: float | None = None
        self.disconnected = asyncio.Event()
        self.finished = asyncio.Event()
        self.digest = hashlib.sha256()
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    def blocked_for(self) -> float:
        """How long the current write has been waiting for the socket (0 when none waits)."""
        return 0.0 if self.draining_since is None else time.monotonic() - self.draining_since

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            frame = b"%x\r\n" % len(EVENT) + EVENT + b"\r\n"
            while self.sent < TOTAL:
                writer.write(frame)
                self.digest.update(EVENT)
                self.draining_since = time.monotonic()
                await writer.drain()
                self.drain_wait_max = max(self.drain_wait_max, time.monotonic() - self.draining_since)
                self.draining_since = None
                self.sent += len(EVENT)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            self.finished.set()
        except (ConnectionError, asyncio.IncompleteReadError):
            self.disconnected.set()
        finally:
            self.draining_since = None
            writer.close()


@pytest.fixture
async def flood() -> AsyncIterator[FloodUpstream]:
    server = FloodUpstream()
    await server.start()
    yield server
    await server.close()


class RssSampler:
    """The highest RSS seen every 20 ms while it runs."""

    def __init__(self) -> None:
        self.peak = rss_bytes()
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            await asyncio.sleep(0.02)

    async def stop(self) -> int:
        self._stop.set()
        await self._task
        return self.peak


REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
           b"Content-Length: 28\r\n\r\n" b'{"model":"m","stream":true}\n')


async def slow_reader(proxy: RunningProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw client with a small, fixed receive buffer (no kernel autotuning hiding the pace)."""
    host, port = proxy.proxy_url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=64 * 1024)
    writer.write(REQUEST)
    await writer.drain()
    return reader, writer


async def test_paused_client_blocks_the_upstream_and_proxy_memory_stays_bounded(
        flood: FloodUpstream, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(flood.url)
    before = settle_memory()
    sampler = RssSampler()
    reader, writer = await slow_reader(proxy)
    read = len(await reader.readuntil(b"\r\n\r\n"))
    while read < 4 * MIB:  # read a little, then stop reading for two seconds
        read += len(await reader.read(64 * 1024))
    read_when_paused = read
    await asyncio.sleep(2.0)
    sent_when_paused = flood.sent
    blocked = flood.blocked_for()
    await asyncio.sleep(0.5)
    sent_after_more_pause = flood.sent
    # then read slowly (1 MiB every 0.1 s) for a second: the upstream keeps pace with it
    slow_started_sent, slow_started_read = flood.sent, read
    for _ in range(10):
        goal = read + MIB
        while read < goal:
            read += len(await reader.read(64 * 1024))
        await asyncio.sleep(0.1)
    slow_sent, slow_read = flood.sent - slow_started_sent, read - slow_started_read
    writer.close()
    await asyncio.wait_for(flood.disconnected.wait(), 10)
    peak = await sampler.stop()
    print(f"\nupstream sent {sent_when_paused / MIB:.1f} MiB while the client had read "
          f"{read_when_paused / MIB:.1f} MiB and paused; blocked in drain for {blocked:.2f} s; "
          f"+{(sent_after_more_pause - sent_when_paused) / MIB:.2f} MiB in 0.5 s more pause; "
          f"while reading {slow_read / MIB:.1f} MiB slowly the upstream sent "
          f"{slow_sent / MIB:.1f} MiB; proxy RSS growth peak {(peak - before) / MIB:.1f} MiB")
    assert sent_when_paused < TOTAL // 4  # nowhere near the 200 MiB it wanted to send
    assert blocked > 1.0  # its write waits for the socket: the pause reached it
    assert sent_after_more_pause - sent_when_paused < MIB
    assert abs(slow_sent - slow_read) < 16 * MIB  # it went at the client's pace, give or take the buffers
    assert peak - before < RSS_GROWTH_LIMIT
    record = await the_record(proxy)
    assert record.stop_reason == "client_disconnect"
    assert proxy.concurrency.in_flight == 0


async def the_record(proxy: RunningProxy) -> ResponseRecord:
    """The one record of the test's one request, once it is stored."""
    for _ in range(100):
        if proxy.store.total:
            break
        await asyncio.sleep(0.02)
    return next(proxy.store.newest_first())


async def test_fast_client_gets_all_200_mib_unchanged_with_bounded_proxy_memory(
        flood: FloodUpstream, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(flood.url)
    before = settle_memory()
    sampler = RssSampler()
    digest = hashlib.sha256()
    received = 0
    async with aiohttp.ClientSession() as session, session.post(
            proxy.proxy_url + "/v1/chat/completions", json={"model": "m", "stream": True}) as response:
        async for chunk in response.content.iter_any():
            digest.update(chunk)
            received += len(chunk)
    peak = await sampler.stop()
    await asyncio.wait_for(flood.finished.wait(), 10)
    print(f"\n{received / MIB:.0f} MiB through the proxy; RSS growth peak {(peak - before) / MIB:.1f} MiB, "
          f"longest upstream drain {flood.drain_wait_max * 1000:.0f} ms")
    assert received == flood.sent >= TOTAL
    assert digest.digest() == flood.digest.digest()
    assert peak - before < RSS_GROWTH_LIMIT
    record = await the_record(proxy)
    assert record.bytes_out == received
    assert record.stop_reason == "upstream_disconnect"  # no finish_reason, no [DONE]: the stream just ended
