"""A real proxy for the tests: its config on ephemeral loopback ports, and a wait for its records."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from proxy.app import RunningProxy
from proxy.config import HostPort, ProxyConfig
from proxy.record import ResponseRecord

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
