"""Shared fixtures: a scripted upstream on loopback and a real proxy in front of it."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest

from proxy.serve.app import RunningProxy, start_proxy
from tests.support.postgres import PostgresServer
from tests.support.proxies import ProxyFactory, proxy_config
from tests.support.scripted_upstream import ScriptedUpstream

# `serve` started by a test keeps its history in memory unless the test names a database: no test
# writes into ~/.local/state (tests/observers/history/ gives each proxy a database of its own).
os.environ.setdefault("LLM_DIAG_HISTORY", "off")


@pytest.fixture
async def upstream() -> AsyncIterator[ScriptedUpstream]:
    server = ScriptedUpstream()
    await server.start()
    yield server
    await server.close()


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


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One real PostgreSQL for the session (initdb and pg_ctl in a temporary directory)."""
    server = PostgresServer()
    yield server
    server.close()


@pytest.fixture
def postgres(postgres_server: PostgresServer) -> PostgresServer:
    """The session's PostgreSQL, running, with no records table (each test makes its own)."""
    try:
        postgres_server.psql("SELECT 1")
    except Exception:
        postgres_server.start()
    postgres_server.reset()
    return postgres_server
