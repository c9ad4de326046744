"""GPU memory and utilization read through NVML (`pynvml`), polled off the event loop.

NVML calls block, so every one of them runs on the poller's own single thread; the event
loop only awaits the result, stores it in a ring and sets the gauges. Without a driver the
poller logs one line, sets `llm_proxy_gpu_telemetry_up 0` and retries quietly and slowly.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml  # type: ignore[import-untyped]  # nvidia-ml-py ships no type hints
import structlog

from proxy.observers.metrics import ProcessMetrics
from proxy.observers.telemetry.samples import SampleRing

_log = structlog.get_logger("llm_diag_proxy.telemetry")

# Per GPU, at most this many processes get a `gpu_process_memory` series (the largest).
MAX_PROCESS_SERIES_PER_GPU = 32
CLOSE_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A compute process on a GPU; `used_bytes` is None where NVML cannot say (e.g. WDDM)."""

    pid: int
    name: str
    used_bytes: int | None


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU at one moment, as NVML reported it."""

    index: int
    uuid: str
    name: str
    used_bytes: int
    free_bytes: int
    total_bytes: int
    utilization_ratio: float | None
    processes: tuple[GpuProcess, ...]


@dataclass(frozen=True, slots=True)
class GpuSnapshot:
    """Every GPU that could be read in one poll, and the NVML errors met along the way.

    `errors` holds one `call: ErrorClass` string per failed call kind; a GPU whose memory
    could not be read is left out (its series are removed), not reported as zero.
    """

    gpus: tuple[GpuReading, ...]
    device_count: int
    errors: tuple[str, ...] = ()


def error_kind(call: str, exc: BaseException) -> str:
    """A short, bounded name for a failure: `nvmlDeviceGetMemoryInfo: NVMLError_GpuIsLost`."""
    return f"{call}: {type(exc).__name__}"


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def attributed_gpu(gpus: Sequence[GpuReading], upstream_pids: Collection[int]) -> GpuReading | None:
    """The GPU a response is attributed to.

    1. The GPUs running one of the upstream's processes (pid or descendant), if any is
       known there; of several (tensor parallel), the one with the least free memory,
       because that is where an out-of-memory hits first.
    2. Else the only GPU.
    3. Else the GPU with the most memory in use (lowest index on a tie).
    """
    if not gpus:
        return None
    if upstream_pids:
        hosting = [g for g in gpus if any(p.pid in upstream_pids for p in g.processes)]
        if hosting:
            return min(hosting, key=lambda g: (g.free_bytes, g.index))
    if len(gpus) == 1:
        return gpus[0]
    return max(gpus, key=lambda g: (g.used_bytes, -g.index))


class NvmlReader:
    """The blocking half: NVML init, one full read, shutdown. Call it from one thread only."""

    def __init__(self, proc_root: Path = Path("/proc")) -> None:
        self.proc_root = proc_root
        self.initialized = False
        self._names: dict[int, str] = {}

    def init(self) -> None:
        pynvml.nvmlInit()
        self.initialized = True

    def shutdown(self) -> None:
        """Shut NVML down if it was initialized; a failure here changes nothing for the user."""
        if not self.initialized:
            return
        self.initialized = False
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()

    def process_name(self, pid: int) -> str:
        """The process' `comm` from procfs where readable, else "" (another user, another pid ns)."""
        name = self._names.get(pid)
        if name is None:
            try:
                name = (self.proc_root / str(pid) / "comm").read_text(errors="replace").strip()
            except OSError:
                name = ""
            self._names[pid] = name
        return name

    def read(self) -> GpuSnapshot:
        """Read every GPU; raises NVMLError only when not even the device count can be read."""
        count = pynvml.nvmlDeviceGetCount()
        errors: list[str] = []
        gpus: list[GpuReading] = []
        seen_pids: set[int] = set()
        for index in range(count):
            reading = self._read_device(index, errors)
            if reading is not None:
                gpus.append(reading)
                seen_pids.update(p.pid for p in reading.processes)
        for pid in [p for p in self._names if p not in seen_pids]:
            del self._names[pid]  # a pid that left may come back as another program
        return GpuSnapshot(tuple(gpus), count, tuple(dict.fromkeys(errors)))

    def _read_device(self, index: int, errors: list[str]) -> GpuReading | None:
        call = "nvmlDeviceGetHandleByIndex"
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            call = "nvmlDeviceGetMemoryInfo"
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            call = "nvmlDeviceGetUUID"
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            call = "nvmlDeviceGetName"
            name = _text(pynvml.nvmlDeviceGetName(handle))
        except pynvml.NVMLError as exc:
            errors.append(error_kind(call, exc))
            return None
        try:
            utilization: float | None = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
        except pynvml.NVMLError as exc:
            errors.append(error_kind("nvmlDeviceGetUtilizationRates", exc))
            utilization = None
        processes: tuple[GpuProcess, ...] = ()
        try:
            running = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            processes = tuple(
                GpuProcess(int(p.pid), self.process_name(int(p.pid)),
                           None if p.usedGpuMemory is None else int(p.usedGpuMemory))
                for p in running)
        except pynvml.NVMLError as exc:
            errors.append(error_kind("nvmlDeviceGetComputeRunningProcesses", exc))
        return GpuReading(index, uuid, name, int(memory.used), int(memory.free), int(memory.total),
                          utilization, processes)


class GpuSeries:
    """Sets the GPU gauges from a snapshot and removes the series of GPUs and processes gone."""

    def __init__(self, metrics: ProcessMetrics) -> None:
        self.m = metrics
        self._gpus: set[tuple[str, str, str]] = set()
        self._utilization: set[tuple[str, str, str]] = set()
        self._processes: set[tuple[str, str, str]] = set()

    def update(self, snapshot: GpuSnapshot) -> None:
        m = self.m
        gpus: set[tuple[str, str, str]] = set()
        utilization: set[tuple[str, str, str]] = set()
        processes: set[tuple[str, str, str]] = set()
        for g in snapshot.gpus:
            labels = (str(g.index), g.uuid, g.name)
            gpus.add(labels)
            m.gpu_memory_used.labels(*labels).set(g.used_bytes)
            m.gpu_memory_free.labels(*labels).set(g.free_bytes)
            m.gpu_memory_total.labels(*labels).set(g.total_bytes)
            if g.utilization_ratio is not None:
                utilization.add(labels)
                m.gpu_utilization.labels(*labels).set(g.utilization_ratio)
            known = sorted((p for p in g.processes if p.used_bytes is not None),
                           key=lambda p: -(p.used_bytes or 0))[:MAX_PROCESS_SERIES_PER_GPU]
            for p in known:
                key = (str(g.index), str(p.pid), p.name)
                processes.add(key)
                m.gpu_process_memory.labels(*key).set(p.used_bytes or 0)
        for labels in self._gpus - gpus:
            for gauge in (m.gpu_memory_used, m.gpu_memory_free, m.gpu_memory_total):
                _remove(gauge, labels)
        for labels in (self._utilization - utilization) | (self._gpus - gpus):
            _remove(m.gpu_utilization, labels)
        for key in self._processes - processes:
            _remove(m.gpu_process_memory, key)
        self._gpus, self._utilization, self._processes = gpus, utilization, processes

    def clear(self) -> None:
        """Remove every GPU series: while NVML fails, their last values would be stale."""
        self.update(GpuSnapshot((), 0))


def _remove(gauge: Any, labels: tuple[str, ...]) -> None:
    with contextlib.suppress(KeyError):
        gauge.remove(*labels)


class GpuPoller:
    """Polls NVML every `interval_s`, keeps the samples in `ring`, and exports them.

    Errors are logged once per kind. After a failure the poller waits `retry_s` (slower
    than the normal pace) and tries again, re-initializing NVML if the whole read failed.
    """

    def __init__(self, interval_s: float, metrics: ProcessMetrics, ring: SampleRing[GpuSnapshot],
                 reader: NvmlReader | None = None, retry_s: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.interval_s = interval_s
        self.retry_s = retry_s if retry_s is not None else min(max(10 * interval_s, 10.0), 60.0)
        self.metrics = metrics
        self.ring = ring
        self.reader = reader if reader is not None else NvmlReader()
        self.clock = clock
        self.series = GpuSeries(metrics)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvml")
        self._logged: set[str] = set()
        self._ever_up = False
        self._failing = False
        self.closed = False

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run a blocking NVML or procfs call on the poller's own thread."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn)

    def _log_once(self, event: str, kind: str, **fields: Any) -> None:
        if kind in self._logged:
            return
        self._logged.add(kind)
        _log.warning(event, error=kind, **fields)

    async def poll_once(self) -> bool:
        """One attempt: init if needed, read, store, export. True when a read succeeded."""
        up = self.metrics.gpu_telemetry_up
        if not self.reader.initialized:
            try:
                await self.call(self.reader.init)
            except pynvml.NVMLError as exc:
                kind = error_kind("nvmlInit", exc)
                if not self._ever_up and not self._logged:
                    self._logged.add(kind)
                    _log.warning("gpu_telemetry_unavailable", reason=str(exc), error=kind,
                                 note="no usable NVIDIA driver: GPU gauges stay empty, "
                                      "llm_proxy_gpu_telemetry_up is 0, records carry no vram fields")
                else:
                    self._log_once("gpu_telemetry_error", kind)
                up.set(0)
                self._failing = True
                return False
        try:
            snapshot: GpuSnapshot = await self.call(self.reader.read)
        except pynvml.NVMLError as exc:
            self._log_once("gpu_telemetry_error", error_kind("nvmlDeviceGetCount", exc))
            await self.call(self.reader.shutdown)
            self.series.clear()
            up.set(0)
            self._failing = True
            return False
        self.ring.append(self.clock(), snapshot)
        self.series.update(snapshot)
        for kind in snapshot.errors:
            self._log_once("gpu_telemetry_error", kind)
        ok = bool(snapshot.gpus) or snapshot.device_count == 0
        up.set(1 if ok else 0)
        if ok and (self._failing or not self._ever_up):
            _log.info("gpu_telemetry_available" if not self._ever_up else "gpu_telemetry_recovered",
                      gpus=len(snapshot.gpus))
            self._ever_up = True
        self._failing = not ok
        return ok

    async def run(self) -> None:
        while True:
            ok = await self.poll_once()
            await asyncio.sleep(self.interval_s if ok else self.retry_s)

    async def close(self) -> None:
        """Shut NVML down on the poller's thread (after any read in flight), then the thread."""
        self.closed = True
        try:  # a hung driver call must not hold the proxy's shutdown hostage
            await asyncio.wait_for(self.call(self.reader.shutdown), CLOSE_TIMEOUT_S)
        except TimeoutError:
            _log.warning("gpu_telemetry_shutdown_timeout", timeout_s=CLOSE_TIMEOUT_S)
        finally:
            self.executor.shutdown(wait=False)
