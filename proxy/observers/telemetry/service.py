"""Starts and stops the telemetry pollers and hands out the enricher that reads their rings."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import aiohttp
import structlog

from proxy.config import ProxyConfig
from proxy.observers.metrics import ProcessMetrics
from proxy.observers.telemetry.enricher import TelemetryEnricher
from proxy.observers.telemetry.gpu import GpuPoller, GpuSnapshot, NvmlReader
from proxy.observers.telemetry.pids import local_port, upstream_pids
from proxy.observers.telemetry.samples import SampleRing, capacity_for
from proxy.observers.telemetry.server_metrics import UpstreamPoller, UpstreamSeries, UpstreamState

_log = structlog.get_logger("llm_diag_proxy.telemetry")

PID_REFRESH_S = 30.0


class TelemetryRings:
    """The samples a process's enricher reads: kept by the pollers of this process (`Telemetry`),
    or, in a worker of `--workers N`, by the supervisor's, which passes each sample on (`receive`)."""

    def __init__(self, config: ProxyConfig) -> None:
        self.gpu: SampleRing[GpuSnapshot] | None = None
        if config.gpu_poll_interval_s > 0:
            self.gpu = SampleRing(capacity_for(config.gpu_poll_interval_s))
        self.upstream: SampleRing[UpstreamState] | None = None
        if config.upstream_metrics != "off" and config.upstream_metrics_interval_s > 0:
            self.upstream = SampleRing(capacity_for(config.upstream_metrics_interval_s))
        self.pids: frozenset[int] = frozenset()  # the upstream's processes, for GPU attribution
        self.enricher = TelemetryEnricher(self.gpu, config.gpu_poll_interval_s, self.upstream,
                                          config.upstream_metrics_interval_s, upstream_pids=lambda: self.pids)

    def receive(self, gpu: tuple[tuple[float, GpuSnapshot], ...], upstream: tuple[tuple[float, UpstreamState], ...],
                pids: frozenset[int] | None) -> None:
        """Samples another process's pollers took (the supervisor's)."""
        if self.gpu is not None:
            for t, snapshot in gpu:
                self.gpu.append(t, snapshot)
        if self.upstream is not None:
            for t, state in upstream:
                self.upstream.append(t, state)
        if pids is not None:
            self.pids = pids


class Telemetry:
    """GPU (NVML) and upstream-state telemetry for one proxy: `await start()`, `await stop()`.

    With `gpu_poll_interval_s == 0` or `upstream_metrics == "off"` that half is not started
    and its record fields stay None. Nothing here can stop the proxy from serving. With N workers
    it runs in the supervisor alone, which passes its samples on to the workers' rings.
    """

    def __init__(self, config: ProxyConfig, metrics: ProcessMetrics, *, nvml_reader: NvmlReader | None = None,
                 redetect_s: float = 30.0, gpu_retry_s: float | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self._tasks: list[asyncio.Task[Any]] = []
        self._session: aiohttp.ClientSession | None = None
        self._redetect_s = redetect_s
        self.rings = TelemetryRings(config)
        self.on_pids: Callable[[frozenset[int]], None] = lambda pids: None  # told when the upstream's change
        self.gpu_poller: GpuPoller | None = None
        if self.rings.gpu is not None:
            self.gpu_poller = GpuPoller(config.gpu_poll_interval_s, metrics, self.rings.gpu,
                                        reader=nvml_reader, retry_s=gpu_retry_s)
        else:
            metrics.gpu_telemetry_up.set(0)
        self.upstream_poller: UpstreamPoller | None = None
        if self.rings.upstream is None:
            UpstreamSeries(metrics).unknown()  # not read: NaN, not a 0 that looks like a reading

    @property
    def gpu_ring(self) -> SampleRing[GpuSnapshot] | None:
        return self.rings.gpu

    @property
    def upstream_ring(self) -> SampleRing[UpstreamState] | None:
        return self.rings.upstream

    @property
    def enricher(self) -> TelemetryEnricher:
        """The enricher that reads the pollers' rings, first in the proxy's chain."""
        return self.rings.enricher

    async def start(self) -> None:
        if self.gpu_poller is not None:
            self._tasks.append(asyncio.create_task(self.gpu_poller.run(), name="telemetry-gpu"))
            if local_port(self.config.upstream) is not None:
                self._tasks.append(asyncio.create_task(self._refresh_pids(), name="telemetry-pids"))
        mode = self.config.upstream_metrics
        if self.rings.upstream is not None and mode != "off":
            interval = self.config.upstream_metrics_interval_s
            timeout = aiohttp.ClientTimeout(total=min(10.0, max(2.0, 3 * interval)))
            authorization = self.config.upstream_authorization
            self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=True,
                                                  headers={"Authorization": authorization} if authorization else None)
            self.upstream_poller = UpstreamPoller(
                self.config.upstream, mode, interval, self.metrics, self.rings.upstream, self._session,
                redetect_s=self._redetect_s)
            self._tasks.append(asyncio.create_task(self.upstream_poller.run(), name="telemetry-upstream"))

    async def _refresh_pids(self) -> None:
        """Who serves the upstream on this machine, for GPU attribution; refreshed as servers restart."""
        assert self.gpu_poller is not None
        while True:
            try:
                pids = await self.gpu_poller.call(lambda: upstream_pids(self.config.upstream))
                if pids != self.rings.pids:
                    self.rings.pids = pids
                    self.on_pids(pids)
            except Exception as exc:  # procfs oddities must not end the refresh
                _log.debug("upstream_pids_failed", error=repr(exc)[:200])
            await asyncio.sleep(PID_REFRESH_S)

    async def stop(self) -> None:
        """Cancel the pollers, close the HTTP session, shut NVML down (on its own thread)."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self.gpu_poller is not None and not self.gpu_poller.closed:
            await self.gpu_poller.close()
