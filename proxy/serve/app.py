"""The proxy in one process: the serving process (`proxy.serve.process`), run once, beside the admin
listener and the telemetry pollers, and a shutdown that ends every stream visibly and writes its
record before the process exits."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import aiohttp
import structlog
from aiohttp import web

from proxy.config import ProxyConfig
from proxy.diagnosis.delivery import Delivery
from proxy.diagnosis.server_check import ServerCheck
from proxy.observers.history import History
from proxy.observers.hooks import Observer
from proxy.observers.metrics import ProxyMetrics
from proxy.observers.record_store import RecordStore
from proxy.observers.telemetry import Telemetry
from proxy.observers.tracing import Tracer, TracingUnavailable
from proxy.relay.forward import Forwarder
from proxy.relay.in_flight import InFlightTracker
from proxy.relay.listeners import listen
from proxy.serve.admin import UpstreamReachability, build_admin_app
from proxy.serve.admin_reads import AdminReaders
from proxy.serve.process import RUNNER_SHUTDOWN_S, LocalRecords, ServingProcess
from proxy.serve.trace_receiver import TraceReceiver
from proxy.serve.wiring import about, history_shown, open_files, run_loop, settle_heap, until_stopped, upstream_session

_log = structlog.get_logger("llm_diag_proxy")


@dataclass
class RunningProxy:
    """A started proxy: its two listeners, its records and metrics (read through `store`, `metrics`
    and `history`, every finished record is in them: those waiting for their batch are delivered
    first)."""

    config: ProxyConfig
    serving: ServingProcess
    _metrics: ProxyMetrics
    telemetry: Telemetry
    session: aiohttp.ClientSession
    readers: AdminReaders = field(default_factory=AdminReaders)
    proxy_url: str = ""
    admin_url: str = ""
    _admin_runner: web.BaseRunner | None = None
    _closed: bool = False

    @property
    def delivery(self) -> Delivery:
        return self.serving.delivery

    @property
    def store(self) -> RecordStore:
        self.delivery.flush()
        return self.serving.store

    @property
    def metrics(self) -> ProxyMetrics:
        self.delivery.flush()
        return self._metrics

    @property
    def history(self) -> History | None:
        self.delivery.flush()
        return self.serving.history

    @property
    def concurrency(self) -> InFlightTracker:
        return self.serving.concurrency

    @property
    def forwarder(self) -> Forwarder:
        return self.serving.forwarder

    @property
    def check(self) -> ServerCheck:
        return self.serving.check

    @property
    def tracer(self) -> Tracer | None:
        return self.serving.tracer

    @property
    def runners(self) -> list[web.BaseRunner]:
        """The proxy listener's and the admin listener's."""
        return [runner for runner in (self.serving.runner, self._admin_runner) if runner is not None]

    async def shutdown(self, grace_s: float) -> float:
        """Stop: refuse new connections and requests at once, let open exchanges finish for up to
        `grace_s`, end the rest visibly (`proxy_shutdown`), write every record, close. Returns the
        seconds it took."""
        started = time.monotonic()
        await self.serving.stop(grace_s)
        await self.close()
        return time.monotonic() - started

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.serving.close()
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()
        await self.telemetry.stop()
        await self.session.close()


async def start_proxy(config: ProxyConfig, *, extra_observers: tuple[Observer, ...] = (),
                      log_records: bool | None = None) -> RunningProxy:
    """Start both listeners (port 0 picks a free port) and return once they accept connections."""
    metrics = ProxyMetrics(max_models=config.max_models, max_clients=config.client_metrics)
    telemetry = Telemetry(config, metrics)
    serving = ServingProcess.open(config, metrics, telemetry.enricher, extra_observers=extra_observers,
                                  log_records=log_records)
    gate = serving.forwarder.gate
    metrics.read_state(in_flight=lambda: serving.concurrency.in_flight,
                       parse_bytes_used=lambda: serving.parse_bytes.used,
                       parse_bytes_refusals=lambda: serving.parse_bytes.refused,
                       admission_waiting=lambda: gate.waiting if gate is not None else 0,
                       admission_limit=lambda: (gate.settings.max_in_flight or 0) if gate is not None else 0)
    session = upstream_session(config)
    running = RunningProxy(config, serving, metrics, telemetry, session)
    admin_app = build_admin_app(
        LocalRecords(serving), metrics.registry,
        UpstreamReachability(config.upstream, session, config.upstream_authorization), config.admin_token,
        ready=lambda: not serving.forwarder.shutting_down, allowed_hosts=config.admin_allowed_hosts,
        readers=running.readers, instance=config.instance,
        about=about(config, lambda: running.proxy_url, lambda: running.admin_url, lambda: serving.check.identity),
        traces=TraceReceiver(serving.traces.receive, metrics.count_spans).handle if serving.traces else None,
        admission=gate)
    try:
        running.proxy_url = await serving.listen()
        running._admin_runner, _, running.admin_url = await listen(
            admin_app, config.admin_listen, backlog=config.backlog, header_timeout_s=config.header_timeout_s,
            on_refused=metrics.count_refused, shutdown_timeout=RUNNER_SHUTDOWN_S)
        await telemetry.start()
    except BaseException:
        await running.close()
        raise
    return running


def serve_forever(config: ProxyConfig) -> int:
    """Run the proxy in this one process until SIGINT/SIGTERM; returns the exit code."""
    try:
        return run_loop(_serve(config))
    except KeyboardInterrupt:
        return 0


async def _serve(config: ProxyConfig) -> int:
    files = open_files()
    try:
        running = await start_proxy(config)
    except OSError as exc:
        print(f"llm-diag-proxy: error: cannot listen: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except TracingUnavailable as exc:
        print(f"llm-diag-proxy: error: --otel: {exc}", file=sys.stderr)
        return 2
    settle_heap()
    _log.info("listening", proxy=running.proxy_url, admin=running.admin_url, upstream=config.upstream,
              deadline_s=config.deadline_s, idle_timeout_s=config.idle_timeout_s,
              deadline_mode=config.deadline_mode, shutdown_grace_s=config.shutdown_grace_s,
              instance=config.instance, history=history_shown(config), open_files=files)
    try:
        await until_stopped()
    finally:
        _log.info("stopping", shutdown_grace_s=config.shutdown_grace_s)
        took = await running.shutdown(config.shutdown_grace_s)
        _log.info("stopped", seconds=round(took, 3))
    return 0
