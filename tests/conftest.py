"""Shared fixtures: a scripted upstream on loopback and a real proxy in front of it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from proxy.app import RunningProxy, start_proxy
from proxy.config import HostPort, ProxyConfig
from proxy.record import ResponseRecord
from tests.scripted_upstream import ScriptedUpstream

LOOPBACK_ANY = HostPort("127.0.0.1", 0)


def proxy_config(upstream: str, **overrides: Any) -> ProxyConfig:
    """A proxy config on ephemeral loopback ports, telemetry off, quiet logs."""
    base = ProxyConfig(upstream=upstream, listen=LOOPBACK_ANY, admin_listen=LOOPBACK_ANY,
                       gpu_poll_interval_s=0, upstream_metrics="off", log_records=False)
    return replace(base, **overrides)


@pytest.fixture
async def upstream() -> AsyncIterator[ScriptedUpstream]:
    server = ScriptedUpstream()
    await server.start()
    yield server
    await server.close()


ProxyFactory = Callable[..., Awaitable[RunningProxy]]


@pytest.fixture
async def make_proxy() -> AsyncIterator[ProxyFactory]:
    started: list[RunningProxy] = []

    async def factory(upstream_url: str, **overrides: Any) -> RunningProxy:
        running = await start_proxy(proxy_config(upstream_url, **overrides))
        started.append(running)
        return running

    yield factory
    for running in started:
        await running.close()


@pytest.fixture
async def proxy(upstream: ScriptedUpstream, make_proxy: ProxyFactory) -> RunningProxy:
    return await make_proxy(upstream.url)


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        yield session


async def record_for(proxy: RunningProxy, request_id: str) -> ResponseRecord:
    """The proxy's record of a request, once it is stored (it lands just after the last byte)."""
    for _ in range(500):
        record = proxy.store.get(request_id)
        if record is not None:
            return record
        await asyncio.sleep(0.01)
    raise AssertionError(f"no record for {request_id}")
