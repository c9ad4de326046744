"""1,000 concurrent streams through the proxy to the simulator (its own process), mixed dialects
and faults: every request leaves exactly one truthful record and nothing is left behind.

CI size: one warm-up wave and one measured wave of 1,000 streams (about half a minute on two
cores). benchmarks/soak.py runs the same code for minutes.
"""

from __future__ import annotations

import pytest

from tests.e2e.load.soak import SoakSettings, run_soak

pytestmark = [pytest.mark.load, pytest.mark.timeout(300)]

STREAMS = 1000
RSS_GROWTH_LIMIT_MIB = 48.0  # after a warm-up at the same concurrency; measured growth is a few MiB
FD_MARGIN = 8


async def test_thousand_mixed_streams_leave_one_record_each_and_nothing_behind() -> None:
    settings = SoakSettings(streams=STREAMS, requests_per_worker=1, ring_size=800)  # the warm-up fills it
    report = await run_soak(settings)
    print("\n" + "\n".join(report.lines()))
    assert report.measured is not None and report.warmup is not None
    assert report.measured.requests == STREAMS
    assert set(report.measured.by_scenario) == {"normal", "disconnect", "cut", "slow", "stall"}
    # held together: most of the workers had a stream in flight at the same moment
    assert report.measured.peak_in_flight >= STREAMS // 2
    assert not report.missing and not report.duplicates
    assert report.records_seen == 2 * STREAMS
    assert not report.wrong, report.wrong[:5]
    assert not report.client_errors, report.client_errors[:5]
    assert report.server_errors == []  # a routine disconnect never logs a traceback
    assert report.in_flight_after == 0 and report.in_flight_gauge_after == 0
    assert report.pending_tasks_after == []
    # the ring stays at its bound while more records than it holds went through
    assert report.measured.ring_max == settings.ring_size == report.store_len
    assert report.store_total == 2 * STREAMS
    # no leak: memory and descriptors (apart from the upstream keep-alive pool) come back
    assert report.rss_after_mib - report.rss_before_mib < RSS_GROWTH_LIMIT_MIB
    assert report.fds_after is not None and report.fds_before is not None
    assert report.fds_free_after <= report.fds_free_before + FD_MARGIN
    assert report.fds_after.touching[report.proxy_port] == 0  # every client-side socket closed
    assert report.fds_after.touching[report.upstream_port] <= STREAMS  # the pool holds at most one per stream
