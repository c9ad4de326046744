"""A burst of 1,000 connections while the proxy's event loop is busy: the listen queue holds them.

The clients are another process, so the kernel, not the event loop, decides who gets in: the
proxy's loop is held for a moment (as a long parse or a GC pause would hold it) while all 1,000
connect. What the queue cannot hold the kernel drops; it counts that in `ListenOverflows`, and a
client whose handshake was dropped waits for a retransmission, or is reset. aiohttp's own default
queue of 128 overflowed this way under an outside load test; the proxy's default is 2048.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proxy.serve.app import RunningProxy
from tests.e2e.load.resources import raise_fd_limit
from tests.support.proxies import ProxyFactory
from tests.support.scripted_upstream import ScriptedUpstream

pytestmark = [pytest.mark.load, pytest.mark.timeout(120)]

BURST = 1000
HELD_S = 1.0

CLIENT = """
import socket, sys
socks = []
for _ in range({burst}):
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex(("127.0.0.1", {port}))
    socks.append(s)
print("connecting", flush=True)
sys.stdin.readline()
for s in socks:
    s.close()
"""


def listen_overflows() -> int | None:
    """The kernel's count of connections dropped at a full listen queue (this network namespace)."""
    path = Path("/proc/net/netstat")
    if not path.exists():
        return None
    lines = [line.split() for line in path.read_text().splitlines() if line.startswith("TcpExt:")]
    names, values = lines[0], lines[1]
    return int(values[names.index("ListenOverflows")]) if "ListenOverflows" in names else None


def accepted(proxy: RunningProxy) -> int:
    server = proxy.runners[0].server
    assert server is not None
    return len(server.connections)


async def burst(proxy: RunningProxy) -> tuple[int, int]:
    """(overflows counted by the kernel, connections the proxy then accepted)."""
    port = int(proxy.proxy_url.rsplit(":", 1)[1])
    before = listen_overflows()
    assert before is not None
    client = subprocess.Popen([sys.executable, "-c", CLIENT.format(burst=BURST, port=port)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout is not None and client.stdin is not None
        # the loop is held from before the first connect until well after the last one
        time.sleep(0.2)
        assert client.stdout.readline().strip() == "connecting"
        time.sleep(HELD_S)
        overflows = listen_overflows() - before  # type: ignore[operator]
        for _ in range(100):  # let the loop accept what the queue held
            await asyncio.sleep(0.02)
            if accepted(proxy) >= BURST:
                break
        took = accepted(proxy)
        client.stdin.write("\n")
        client.stdin.flush()
        client.wait(timeout=30)
    finally:
        client.kill()
    return overflows, took


@pytest.fixture(autouse=True)
def _enough_descriptors() -> None:
    if listen_overflows() is None:
        pytest.skip("no /proc/net/netstat with ListenOverflows: the kernel's drops cannot be read")
    if int(Path("/proc/sys/net/core/somaxconn").read_text()) < 2048:
        pytest.skip("net.core.somaxconn < 2048 caps every listen queue below the proxy's default")
    raise_fd_limit(4 * BURST)


async def test_a_burst_of_a_thousand_connects_on_a_busy_loop_is_held_by_the_default_queue(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(upstream.url)  # the default --backlog
    overflows, took = await burst(proxy)
    assert overflows == 0
    assert took == BURST


async def test_the_same_burst_overflows_aiohttps_default_queue(upstream: ScriptedUpstream,
                                                               make_proxy: ProxyFactory) -> None:
    """What the default guards against: with a queue of 128 the kernel drops the rest."""
    proxy = await make_proxy(upstream.url, backlog=128)
    overflows, took = await burst(proxy)
    assert overflows > 0
    assert took < BURST
