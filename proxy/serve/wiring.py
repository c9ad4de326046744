"""What one process and the supervisor of N workers both use around their serving processes: the
event loop, the signals that stop it, the proxy's own session to its upstream, and what
`/api/about` says."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import aiohttp
import structlog

from proxy.config import ProxyConfig
from proxy.relay.upstream.pool import POOLED_IDLE_S
from proxy.servers.base import ServerIdentity

_log = structlog.get_logger("llm_diag_proxy")
T = TypeVar("T")
# The young generation's threshold once serving: a collection per 10,000 objects kept rather than
# CPython's 700. Each request makes a few hundred objects that die with it, most before a
# collection comes; at 700 the collector ran about 16 times a second at 64 paced streams, each
# time walking what the requests in flight held, and moved it on to the older generations.
YOUNG_THRESHOLD = 10_000
# Each stream holds two descriptors (the client's connection and the upstream's) and the pool rests
# a few more: under this many open files a serving process says, at start, what it bounds.
FEW_OPEN_FILES = 4096


def about(config: ProxyConfig, proxy_url: Callable[[], str], admin_url: Callable[[], str],
          identity: Callable[[], ServerIdentity]) -> Callable[[], dict[str, Any]]:
    """`/api/about`'s answer: this proxy's addresses, its name on records, its upstream and what the
    upstream says of itself."""

    def answer() -> dict[str, Any]:
        return {"proxy": {"url": reachable_url(proxy_url()), "admin": reachable_url(admin_url()),
                          "instance": config.instance, "upstream": config.upstream, "workers": config.workers},
                "server": identity().to_dict()}

    return answer


def reachable_url(url: str) -> str:
    """A listening URL as a client on this machine reaches it: a wildcard host (0.0.0.0, [::]) is loopback."""
    return url.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//[::1]:")


def history_shown(config: ProxyConfig) -> str:
    """Where the records go, as the log may say it (a URL's password hidden)."""
    from proxy.observers.history.source import shown

    return "off" if config.history_path is None else shown(config.history_path)


def settle_heap() -> None:
    """Once a serving process is built and listening: what it holds so far (modules, the wiring,
    the observers) lives as long as the process, so the collector stops walking it (`gc.freeze`),
    and it collects the young generation less often (YOUNG_THRESHOLD). Garbage with cycles is still
    collected; a collection of every generation no longer walks the whole start-up heap."""
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)


def open_files() -> int | None:
    """The process's soft limit of open files, raised to its hard limit first (as Go's runtime does
    at start): a soft limit of 1024, a common default, would refuse streams from about 450 at once
    on (every upstream connect failing with EMFILE). Under FEW_OPEN_FILES a warning says what it
    bounds. None where the system has no such limit."""
    try:
        import resource
    except ImportError:  # (not POSIX)
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinity = resource.RLIM_INFINITY
    target = hard if hard != infinity else 1 << 20  # (Linux's default fs.nr_open)
    if soft != infinity and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft == infinity:
        return None
    if soft < FEW_OPEN_FILES:
        _log.warning("few_open_files", limit=soft,
                     note=f"each stream holds two descriptors: past about {soft // 2} streams at once new "
                          "ones fail (502 upstream_unavailable, or their connection refused); raise the hard "
                          "limit (ulimit -Hn, systemd's LimitNOFILE)")
    return soft


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to its end on uvloop, or on asyncio's own loop where uvloop is not built."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def until_stopped(*others: Coroutine[Any, Any, Any]) -> None:
    """Wait for SIGINT or SIGTERM, or for the first of `others` to end."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    waits = [asyncio.ensure_future(stop.wait()), *(asyncio.ensure_future(other) for other in others)]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


def upstream_session(config: ProxyConfig) -> aiohttp.ClientSession:
    """An aiohttp session for the proxy's own requests to the upstream (the admin's reachability
    check): no decompression, no cookie jar, no proxy settings from the environment."""
    return aiohttp.ClientSession(
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        trust_env=False,
        timeout=aiohttp.ClientTimeout(total=None, connect=config.connect_timeout_s, sock_read=None),
        connector=aiohttp.TCPConnector(keepalive_timeout=POOLED_IDLE_S),
    )
