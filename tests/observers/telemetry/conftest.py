"""The fake upstream the telemetry tests scrape."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.support.path_upstream import FakeUpstream


@pytest.fixture
async def fake_upstream() -> AsyncIterator[FakeUpstream]:
    upstream = FakeUpstream()
    await upstream.start()
    yield upstream
    await upstream.close()
