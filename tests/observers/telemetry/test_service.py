"""The Telemetry service: start, stop, and the observer it hands the proxy."""

from __future__ import annotations

import asyncio
import os

import pytest

from proxy.config import ProxyConfig
from proxy.diagnosis.delivery import Delivery
from proxy.observers.metrics import ProxyMetrics
from proxy.observers.telemetry import Telemetry
from proxy.record import ResponseRecord
from tests.observers.telemetry.test_server_metrics import VLLM_V1
from tests.support.fake_nvml import GIB, FakeGpu, FakeNvml
from tests.support.path_upstream import FakeUpstream


def finished(started_at: float, duration_s: float) -> ResponseRecord:
    record = ResponseRecord(request_id="t", method="POST", path="/v1/completions", route="completions",
                            dialect="openai", started_at=started_at, status=200, stop_reason="eos")
    record.duration_s = duration_s
    return record


async def eventually(check: object, what: str) -> None:
    for _ in range(300):
        if callable(check) and check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


async def test_records_are_attributed_to_the_gpu_running_the_upstream_process(
        monkeypatch: pytest.MonkeyPatch, fake_upstream: FakeUpstream) -> None:
    # The fake upstream listens in this very process, so this pid is "the upstream's" pid.
    FakeNvml(monkeypatch, [FakeGpu("GPU-aaaa", "A100", total=80 * GIB, used=60 * GIB),
                           FakeGpu("GPU-bbbb", "A100", total=80 * GIB, used=20 * GIB,
                                   processes=[(os.getpid(), 19 * GIB)])])
    fake_upstream.routes["/metrics"] = (200, VLLM_V1.encode())
    config = ProxyConfig(upstream=fake_upstream.url, gpu_poll_interval_s=0.02, upstream_metrics="auto",
                         upstream_metrics_interval_s=0.02)
    telemetry = Telemetry(config, ProxyMetrics())
    await telemetry.start()
    try:
        await eventually(lambda: os.getpid() in telemetry.rings.pids, "upstream pid never found")
        assert telemetry.gpu_ring is not None and telemetry.upstream_ring is not None
        await eventually(lambda: len(telemetry.gpu_ring) >= 3 and len(telemetry.upstream_ring) >= 3,  # type: ignore[arg-type]
                         "no samples")
        latest = telemetry.gpu_ring.latest()
        assert latest is not None
        record = finished(latest[0] - 0.05, 0.05)
        Delivery(enrichers=[telemetry.enricher]).response_finished(record)
    finally:
        await telemetry.stop()
    assert record.gpu == "1"
    assert (record.vram_used_max_bytes, record.vram_free_min_bytes) == (20 * GIB, 60 * GIB)
    assert (record.upstream_running_max, record.kv_cache_usage_max) == (9.0, 0.81)


async def test_stop_ends_every_poller_and_can_be_called_twice(fake_upstream: FakeUpstream) -> None:
    config = ProxyConfig(upstream=fake_upstream.url, gpu_poll_interval_s=0.02, upstream_metrics="auto",
                         upstream_metrics_interval_s=0.02)
    telemetry = Telemetry(config, ProxyMetrics(), redetect_s=0.02)
    before = {t for t in asyncio.all_tasks()}
    await telemetry.start()
    await asyncio.sleep(0.1)
    await telemetry.stop()
    await telemetry.stop()
    assert {t for t in asyncio.all_tasks()} - before == set()
    assert telemetry._session is None


async def test_intervals_of_zero_and_off_start_nothing_and_leave_records_alone(
        fake_upstream: FakeUpstream) -> None:
    metrics = ProxyMetrics()
    config = ProxyConfig(upstream=fake_upstream.url, gpu_poll_interval_s=0, upstream_metrics="off")
    telemetry = Telemetry(config, metrics)
    await telemetry.start()
    record = finished(1000.0, 1.0)
    Delivery(enrichers=[telemetry.enricher]).response_finished(record)
    await telemetry.stop()
    assert telemetry._tasks == [] and fake_upstream.hits == []
    assert metrics.registry.get_sample_value("llm_proxy_gpu_telemetry_up") == 0
    assert metrics.registry.get_sample_value("llm_proxy_upstream_requests_running") is None  # absent, not NaN
    assert (record.gpu, record.upstream_running_max) == (None, None)
