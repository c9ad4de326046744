"""libnvidia-ml behind pynvml's functions, in memory: GPUs with memory, processes and errors that
tests set, as the NVML path of the telemetry reads them."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

GIB = 1 << 30


@dataclass
class FakeGpu:
    uuid: str
    name: str
    total: int = 24 * GIB
    used: int = 2 * GIB
    utilization: int = 50
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, used bytes)
    errors: dict[str, pynvml.NVMLError] = field(default_factory=dict)  # call name -> error to raise


class FakeNvml:
    """Stands in for libnvidia-ml behind pynvml's functions; tests edit `gpus` and `errors`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGpu]) -> None:
        self.gpus = gpus
        self.init_error: pynvml.NVMLError | None = None
        self.count_error: pynvml.NVMLError | None = None
        self.inits = 0
        self.shutdowns = 0
        for name in ("nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex",
                     "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUtilizationRates",
                     "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetName", "nvmlDeviceGetUUID"):
            monkeypatch.setattr(pynvml, name, getattr(self, name))

    def _check(self, gpu: FakeGpu, call: str) -> None:
        error = gpu.errors.get(call)
        if error is not None:
            raise error

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        if self.count_error is not None:
            raise self.count_error
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        if index >= len(self.gpus):
            raise pynvml.NVMLError_InvalidArgument()
        gpu = self.gpus[index]
        self._check(gpu, "nvmlDeviceGetHandleByIndex")
        return gpu

    def nvmlDeviceGetMemoryInfo(self, gpu: FakeGpu) -> Any:
        self._check(gpu, "nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=gpu.total, used=gpu.used, free=gpu.total - gpu.used)

    def nvmlDeviceGetUtilizationRates(self, gpu: FakeGpu) -> Any:
        self._check(gpu, "nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=gpu.utilization, memory=10)

    def nvmlDeviceGetComputeRunningProcesses(self, gpu: FakeGpu) -> list[Any]:
        self._check(gpu, "nvmlDeviceGetComputeRunningProcesses")
        return [SimpleNamespace(pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF,
                                computeInstanceId=0xFFFFFFFF) for pid, used in gpu.processes]

    def nvmlDeviceGetName(self, gpu: FakeGpu) -> str:
        self._check(gpu, "nvmlDeviceGetName")
        return gpu.name

    def nvmlDeviceGetUUID(self, gpu: FakeGpu) -> str:
        self._check(gpu, "nvmlDeviceGetUUID")
        return gpu.uuid
