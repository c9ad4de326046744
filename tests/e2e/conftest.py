"""Fixtures of the tests that start a whole proxy: raw upstreams whose bytes the tests check."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tests.support.keepalive_upstream import KeepAliveUpstream
from tests.support.raw_http import RawUpstream


@pytest.fixture
async def raw() -> AsyncIterator[RawUpstream]:
    upstream = RawUpstream()
    upstream.server = await asyncio.start_server(upstream.serve, "127.0.0.1", 0)
    yield upstream
    upstream.server.close()


@pytest.fixture
async def keepalive() -> AsyncIterator[KeepAliveUpstream]:
    upstream = KeepAliveUpstream()
    upstream.server = await asyncio.start_server(upstream._serve, "127.0.0.1", 0)
    yield upstream
    upstream.server.close()
