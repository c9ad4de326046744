"""GPU telemetry: NVML faked at the pynvml function boundary, and the real no-driver path."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pynvml
import pytest
from prometheus_client import generate_latest
from structlog.testing import capture_logs

from proxy.observers.metrics import ProxyMetrics
from proxy.observers.telemetry.gpu import (
    GpuPoller,
    GpuProcess,
    GpuReading,
    GpuSnapshot,
    NvmlReader,
    attributed_gpu,
)
from proxy.observers.telemetry.samples import SampleRing
from tests.support.fake_nvml import GIB, FakeGpu, FakeNvml


def two_gpus() -> list[FakeGpu]:
    return [FakeGpu("GPU-aaaa", "NVIDIA H100 80GB HBM3", total=80 * GIB, used=70 * GIB,
                    processes=[(os.getpid(), 69 * GIB)]),
            FakeGpu("GPU-bbbb", "NVIDIA H100 80GB HBM3", total=80 * GIB, used=1 * GIB)]


def sample(metrics: ProxyMetrics, metric: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(metric, labels)


def series(metrics: ProxyMetrics, prefix: str) -> list[str]:
    text = generate_latest(metrics.registry).decode()
    return [line for line in text.splitlines() if line.startswith(prefix)]


def make_poller(metrics: ProxyMetrics) -> tuple[GpuPoller, SampleRing[GpuSnapshot]]:
    ring: SampleRing[GpuSnapshot] = SampleRing(100)
    clock = iter(float(t) for t in range(1000, 100_000))
    return GpuPoller(1.0, metrics, ring, retry_s=0.01, clock=lambda: next(clock)), ring


@contextlib.asynccontextmanager
async def polling(monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGpu]) -> AsyncIterator[
        tuple[ProxyMetrics, GpuPoller]]:
    """A poller of these GPUs and its metrics, closed after."""
    FakeNvml(monkeypatch, gpus)
    metrics = ProxyMetrics()
    poller, _ = make_poller(metrics)
    try:
        yield metrics, poller
    finally:
        await poller.close()


async def polled_once(monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGpu]) -> tuple[
        ProxyMetrics, SampleRing[GpuSnapshot], bool]:
    """One poll of these GPUs: the metrics, the ring, and whether the poll read them."""
    async with polling(monkeypatch, gpus) as (metrics, poller):
        read = await poller.poll_once()
    return metrics, poller.ring, read


async def test_poll_exports_memory_utilization_and_process_memory_per_gpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    metrics, ring, read = await polled_once(monkeypatch, two_gpus())
    assert read
    gpu0 = {"gpu": "0", "uuid": "GPU-aaaa", "name": "NVIDIA H100 80GB HBM3"}
    assert sample(metrics, "llm_proxy_gpu_memory_used_bytes", **gpu0) == 70 * GIB
    assert sample(metrics, "llm_proxy_gpu_memory_free_bytes", **gpu0) == 10 * GIB
    assert sample(metrics, "llm_proxy_gpu_memory_total_bytes", **gpu0) == 80 * GIB
    assert sample(metrics, "llm_proxy_gpu_utilization_ratio", **gpu0) == 0.5
    own_name = Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    assert sample(metrics, "llm_proxy_gpu_process_memory_bytes", gpu="0", pid=str(os.getpid()),
                  process=own_name) == 69 * GIB
    assert sample(metrics, "llm_proxy_gpu_telemetry_up") == 1
    assert len(ring) == 1 and len(ring.latest()[1].gpus) == 2  # type: ignore[index]


async def test_process_whose_comm_cannot_be_read_has_an_empty_name(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [FakeGpu("GPU-aaaa", "L4", processes=[(2**22 + 12345, GIB)])]  # above pid_max: no /proc entry
    FakeNvml(monkeypatch, gpus)
    snapshot = NvmlReader().read()
    assert snapshot.gpus[0].processes == (GpuProcess(2**22 + 12345, "", GIB),)


async def test_process_series_of_a_process_that_went_away_is_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [FakeGpu("GPU-aaaa", "L4", processes=[(4242, GIB), (4343, 2 * GIB)])]
    FakeNvml(monkeypatch, gpus)
    metrics = ProxyMetrics()
    poller, _ = make_poller(metrics)
    try:
        await poller.poll_once()
        assert len(series(metrics, "llm_proxy_gpu_process_memory_bytes{")) == 2
        gpus[0].processes = [(4343, 2 * GIB)]
        await poller.poll_once()
    finally:
        await poller.close()
    remaining = series(metrics, "llm_proxy_gpu_process_memory_bytes{")
    assert len(remaining) == 1 and 'pid="4343"' in remaining[0]


async def test_process_memory_unknown_to_nvml_gets_no_series(monkeypatch: pytest.MonkeyPatch) -> None:
    metrics, ring, _ = await polled_once(monkeypatch, [FakeGpu("GPU-aaaa", "L4", processes=[(4242, None)])])
    assert series(metrics, "llm_proxy_gpu_process_memory_bytes{") == []
    assert ring.latest()[1].gpus[0].processes[0].used_bytes is None  # type: ignore[index]


async def test_gpu_that_vanishes_has_its_series_removed_and_the_others_stay(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = two_gpus()
    async with polling(monkeypatch, gpus) as (metrics, poller):
        await poller.poll_once()
        gpus[0].errors["nvmlDeviceGetMemoryInfo"] = pynvml.NVMLError_GpuIsLost()
        with capture_logs() as logs:
            assert await poller.poll_once()
            await poller.poll_once()
    used = series(metrics, "llm_proxy_gpu_memory_used_bytes{")
    assert len(used) == 1 and 'uuid="GPU-bbbb"' in used[0]
    assert series(metrics, 'llm_proxy_gpu_utilization_ratio{gpu="0"') == []
    assert series(metrics, 'llm_proxy_gpu_process_memory_bytes{gpu="0"') == []
    assert sample(metrics, "llm_proxy_gpu_telemetry_up") == 1
    errors = [entry for entry in logs if entry["event"] == "gpu_telemetry_error"]
    assert [e["error"] for e in errors] == ["nvmlDeviceGetMemoryInfo: NVMLError_GpuIsLost"]  # once


async def test_gpu_removed_from_the_count_has_its_series_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = two_gpus()
    async with polling(monkeypatch, gpus) as (metrics, poller):
        await poller.poll_once()
        del gpus[1]
        await poller.poll_once()
    assert [line.split("uuid=")[1][:10] for line in series(metrics, "llm_proxy_gpu_memory_total_bytes{")] \
        == ['"GPU-aaaa"']


async def test_unsupported_utilization_leaves_only_that_series_out(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGpu("GPU-aaaa", "Tesla T4", errors={"nvmlDeviceGetUtilizationRates": pynvml.NVMLError_NotSupported()})
    metrics, ring, read = await polled_once(monkeypatch, [gpu])
    assert read
    assert series(metrics, "llm_proxy_gpu_utilization_ratio{") == []
    assert len(series(metrics, "llm_proxy_gpu_memory_used_bytes{")) == 1
    assert ring.latest()[1].gpus[0].utilization_ratio is None  # type: ignore[index]


async def test_nvml_failing_mid_run_sets_up_0_logs_once_and_recovers_after_reinit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml(monkeypatch, two_gpus())
    metrics = ProxyMetrics()
    poller, ring = make_poller(metrics)
    try:
        with capture_logs() as logs:
            assert await poller.poll_once()
            nvml.count_error = pynvml.NVMLError_Unknown()
            assert not await poller.poll_once()
            assert not await poller.poll_once()
            assert sample(metrics, "llm_proxy_gpu_telemetry_up") == 0
            assert series(metrics, "llm_proxy_gpu_memory_used_bytes{") == []  # stale values removed
            nvml.count_error = None
            assert await poller.poll_once()
    finally:
        await poller.close()
    assert sample(metrics, "llm_proxy_gpu_telemetry_up") == 1
    assert len(series(metrics, "llm_proxy_gpu_memory_used_bytes{")) == 2
    assert nvml.inits == 3  # initial, then again after each failed read (which shuts NVML down)
    events = [(e["event"], e.get("error")) for e in logs]
    assert events == [("gpu_telemetry_available", None),
                      ("gpu_telemetry_error", "nvmlDeviceGetCount: NVMLError_Unknown"),
                      ("gpu_telemetry_recovered", None)]
    assert len(ring) == 2  # failed polls store no sample


async def test_driver_missing_at_start_logs_one_line_and_keeps_retrying_quietly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml(monkeypatch, two_gpus())
    nvml.init_error = pynvml.NVMLError_DriverNotLoaded()
    metrics = ProxyMetrics()
    poller, ring = make_poller(metrics)
    try:
        with capture_logs() as logs:
            for _ in range(3):
                assert not await poller.poll_once()
            nvml.init_error = None
            assert await poller.poll_once()
    finally:
        await poller.close()
    assert [(e["event"], e.get("reason")) for e in logs] == [
        ("gpu_telemetry_unavailable", "Driver Not Loaded"), ("gpu_telemetry_available", None)]
    assert sample(metrics, "llm_proxy_gpu_telemetry_up") == 1
    assert len(ring) == 1


async def test_no_driver_on_this_machine_gives_up_0_and_one_log_line() -> None:
    try:  # the real path: libnvidia-ml is absent here (and in CI)
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver")
    metrics = ProxyMetrics()
    poller, ring = make_poller(metrics)
    try:
        with capture_logs() as logs:
            assert not await poller.poll_once()
            assert not await poller.poll_once()
    finally:
        await poller.close()
    assert sample(metrics, "llm_proxy_gpu_telemetry_up") == 0
    assert len(logs) == 1
    assert logs[0]["event"] == "gpu_telemetry_unavailable" and logs[0]["log_level"] == "warning"
    assert logs[0]["error"].startswith("nvmlInit: NVMLError_")
    assert series(metrics, "llm_proxy_gpu_memory") == []
    assert len(ring) == 0


async def test_close_shuts_nvml_down_once(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml(monkeypatch, two_gpus())
    poller, _ = make_poller(ProxyMetrics())
    await poller.poll_once()
    await poller.close()
    assert nvml.shutdowns == 1


def reading(index: int, used: int, free: int, pids: tuple[int, ...] = ()) -> GpuReading:
    return GpuReading(index, f"GPU-{index}", "L40S", used, free, used + free, 0.0,
                      tuple(GpuProcess(pid, "x", GIB) for pid in pids))


def test_attribution_prefers_the_gpu_running_an_upstream_process() -> None:
    gpus = [reading(0, 40 * GIB, 8 * GIB), reading(1, 2 * GIB, 46 * GIB, pids=(777,))]
    assert attributed_gpu(gpus, {777, 778}).index == 1  # type: ignore[union-attr]


def test_attribution_across_tensor_parallel_gpus_picks_the_least_free() -> None:
    gpus = [reading(0, 40 * GIB, 8 * GIB, pids=(10,)), reading(1, 44 * GIB, 4 * GIB, pids=(11,)),
            reading(2, 47 * GIB, 1 * GIB)]
    assert attributed_gpu(gpus, {10, 11}).index == 1  # type: ignore[union-attr]


def test_attribution_without_known_upstream_process_takes_the_single_gpu() -> None:
    assert attributed_gpu([reading(0, 1, 2)], {999}).index == 0  # type: ignore[union-attr]


def test_attribution_falls_back_to_the_gpu_with_most_memory_used() -> None:
    gpus = [reading(0, 4 * GIB, 40 * GIB), reading(1, 30 * GIB, 14 * GIB), reading(2, 30 * GIB, 14 * GIB)]
    assert attributed_gpu(gpus, frozenset()).index == 1  # type: ignore[union-attr]
    assert attributed_gpu([], {1}) is None
