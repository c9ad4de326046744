"""A real proxy for the tests: its config on ephemeral loopback ports, and a wait for its records."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from proxy.config import HostPort, ProxyConfig
from proxy.record import ResponseRecord
from proxy.serve.app import RunningProxy
from tests.support.ports import free_port

LOOPBACK_ANY = HostPort("127.0.0.1", 0)
ProxyFactory = Callable[..., Awaitable[RunningProxy]]


def proxy_config(upstream: str, **overrides: Any) -> ProxyConfig:
    """A proxy config on ephemeral loopback ports, telemetry off, quiet logs."""
    base = ProxyConfig(upstream=upstream, listen=LOOPBACK_ANY, admin_listen=LOOPBACK_ANY,
                       gpu_poll_interval_s=0, upstream_metrics="off", log_records=False)
    return replace(base, **overrides)


async def record_for(proxy: RunningProxy, request_id: str) -> ResponseRecord:
    """The proxy's record of a request, once it is stored (it lands just after the last byte)."""
    for _ in range(500):
        record = proxy.store.get(request_id)
        if record is not None:
            return record
        await asyncio.sleep(0.01)
    raise AssertionError(f"no record for {request_id}")


# --- the proxy as a user runs it: `serve` in a process of its own ------------------------------

ROOT = Path(__file__).resolve().parent.parent.parent


@dataclass
class Served:
    process: subprocess.Popen[bytes]
    proxy_url: str
    admin_url: str
    log: Path

    def children(self) -> list[int]:
        """The worker processes' pids (multiprocessing's resource tracker is a child too: not counted)."""
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, IndexError):
                    parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                    if parent == self.process.pid and b"spawn_main" in (entry / "cmdline").read_bytes():
                        found.append(int(entry.name))
        return found

    def lines(self) -> list[dict[str, object]]:
        return [orjson.loads(line) for line in self.log.read_bytes().splitlines() if line.startswith(b"{")]

    def stop(self) -> None:
        """SIGTERM, as a service manager stops it, and wait for the process to end."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=40)


async def start_served(upstream_url: str, tmp_path: Path, *extra: str, workers: int = 1) -> Served:
    """`llm-diag-proxy serve` in a process of its own, as a user runs it; back once it listens.

    Telemetry off and a JSON log in `tmp_path`; `extra` flags come last, so they win.
    """
    port, admin = free_port(), free_port()
    log = tmp_path / "proxy.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--workers", str(workers), "--upstream", upstream_url,
         "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}", "--gpu-poll-interval", "0",
         "--upstream-metrics", "off", "--log-format", "json", *extra],
        cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    served = Served(process, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}", log)
    deadline = time.monotonic() + 60
    while not any(line.get("event") == "listening" for line in served.lines()):
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        await asyncio.sleep(0.1)
    return served
