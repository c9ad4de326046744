"""The proxy in one process: the proxy listener, the admin listener, the observers between them,
and a shutdown that ends every stream visibly and writes its record before the process exits."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

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
from proxy.serve.admin_reads import AdminReaders
from proxy.serve.wiring import (
    RUNNER_SHUTDOWN_S,
    Observing,
    about,
    drain,
    history_shown,
    proxy_application,
    run_loop,
    server_check,
    until_stopped,
    upstream_session,
)
from proxy.wire.byte_budget import ByteBudget

_log = structlog.get_logger("llm_diag_proxy")


@dataclass
class RunningProxy:
    """A started proxy: its two listeners, its record store and metrics (read through `store`,
    `metrics` and `history`, every finished record is in them: those waiting for their batch are
    delivered first)."""

    config: ProxyConfig
    proxy_url: str
    admin_url: str
    _store: RecordStore
    _metrics: ProxyMetrics
    concurrency: InFlightTracker
    observers: Delivery
    forwarder: Forwarder
    _runners: list[web.BaseRunner] = field(default_factory=list)
    _proxy_site: web.TCPSite | None = None
    _session: aiohttp.ClientSession | None = None
    _observing: Observing | None = None
    _history: History | None = None
    tracer: Tracer | None = None
    check: ServerCheck | None = None
    readers: AdminReaders = field(default_factory=AdminReaders)
    _closed: bool = False

    @property
    def store(self) -> RecordStore:
        self.observers.flush()
        return self._store

    @property
    def metrics(self) -> ProxyMetrics:
        self.observers.flush()
        return self._metrics

    @property
    def history(self) -> History | None:
        self.observers.flush()
        return self._history

    @property
    def telemetry(self) -> Telemetry:
        """The GPU and upstream pollers of this proxy."""
        assert self._observing is not None
        return self._observing.telemetry

    async def shutdown(self, grace_s: float) -> float:
        """Stop: refuse new connections and requests at once, let open exchanges finish for up to
        `grace_s`, end the rest visibly (`proxy_shutdown`), write every record, close. Returns the
        seconds it took."""
        started = time.monotonic()
        if self._proxy_site is not None:
            await self._proxy_site.stop()  # the listening socket closes: new connections are refused
            self._proxy_site = None
        await drain(self.forwarder, started + grace_s, grace_s)
        await self.close()
        return time.monotonic() - started

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.forwarder.refuse_new()
        self.forwarder.end_active()
        for runner in self._runners:
            await runner.cleanup()
        self.observers.flush()  # the handlers' last finishes, before the tokenizer's check closes
        if self.check is not None:  # after the handlers: their last records may wait on the tokenizer
            await self.check.close()
        if self._observing is not None:
            await self._observing.close()
        await self.forwarder.close()
        if self._session is not None:
            await self._session.close()


async def start_proxy(config: ProxyConfig, *, extra_observers: tuple[Observer, ...] = (),
                      log_records: bool | None = None) -> RunningProxy:
    """Start both listeners (port 0 picks a free port) and return once they accept connections."""
    observing = Observing.open(config, extra_observers=extra_observers, log_records=log_records)
    metrics, chain = observing.metrics, observing.delivery
    session = upstream_session(config)
    concurrency = InFlightTracker()
    budget = ByteBudget(config.parse_budget_bytes)
    metrics.read_state(in_flight=lambda: concurrency.in_flight, parse_budget_used=lambda: budget.used,
                       parse_budget_refusals=lambda: budget.refused)
    check = server_check(config, chain.response_finished, metrics.count_tokenizer, metrics.know_models,
                         metrics.records_lost.inc)
    forwarder = proxy_application(config, chain, concurrency, budget, check, metrics.count_refused)
    readers = AdminReaders()
    running = RunningProxy(config, "", "", observing.store, metrics, concurrency, chain, forwarder,
                           _observing=observing, _session=session, _history=observing.history,
                           tracer=observing.tracer, check=check, readers=readers)
    admin_app = observing.admin(config, session, ready=lambda: not forwarder.shutting_down, readers=readers,
                                about=about(config, lambda: running.proxy_url, lambda: running.admin_url,
                                            lambda: check.facts))
    options: dict[str, Any] = {"backlog": config.backlog, "header_timeout_s": config.header_timeout_s,
                               "on_refused": metrics.count_refused, "shutdown_timeout": RUNNER_SHUTDOWN_S}
    try:
        # handler_cancellation: a client that goes away cancels its handler at once, so the
        # upstream request is cancelled too (the server frees the sequence's KV blocks).
        runner, running._proxy_site, running.proxy_url = await listen(
            forwarder.handle, config.listen, handler_cancellation=True, **options)
        running._runners.append(runner)
        runner, _, running.admin_url = await listen(admin_app, config.admin_listen, **options)
        running._runners.append(runner)
        await observing.telemetry.start()
        check.start()
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
    try:
        running = await start_proxy(config)
    except OSError as exc:
        print(f"llm-diag-proxy: error: cannot listen: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except TracingUnavailable as exc:
        print(f"llm-diag-proxy: error: --otel: {exc}", file=sys.stderr)
        return 2
    _log.info("listening", proxy=running.proxy_url, admin=running.admin_url, upstream=config.upstream,
              deadline_s=config.deadline_s, idle_timeout_s=config.idle_timeout_s,
              deadline_mode=config.deadline_mode, shutdown_grace_s=config.shutdown_grace_s,
              instance=config.instance, history=history_shown(config))
    try:
        await until_stopped()
    finally:
        _log.info("stopping", shutdown_grace_s=config.shutdown_grace_s)
        took = await running.shutdown(config.shutdown_grace_s)
        _log.info("stopped", seconds=round(took, 3))
    return 0
