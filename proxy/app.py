"""Wiring and lifecycle: the proxy listener, the admin listener, the observers between them, and a
shutdown that ends every stream visibly and writes its record before the process exits."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import structlog
from aiohttp import web

from proxy.admin import UpstreamProbe, build_admin_app
from proxy.admin_reads import AdminReaders
from proxy.budget import ByteBudget
from proxy.concurrency import InFlightTracker
from proxy.config import ProxyConfig
from proxy.forward import Forwarder
from proxy.history import History
from proxy.listeners import listen
from proxy.logs import LogObserver, configure_logging
from proxy.metrics import MetricsObserver, ProxyMetrics
from proxy.observers import ObserverChain
from proxy.record import ResponseRecord
from proxy.server_check import CheckLimits, ServerCheck, open_server_check
from proxy.store import RecordStore
from proxy.telemetry import Telemetry
from proxy.tracing import Tracer, TracingUnavailable
from proxy.upstream_client import upstream_session

T = TypeVar("T")
_log = structlog.get_logger("llm_diag_proxy")
# After the grace, the streams still open are ended at once; their handlers then need a moment to
# write the end to the client and the record to the observers.
END_WAIT_S = 2.0
RUNNER_SHUTDOWN_S = 1.0  # what aiohttp gives its own handlers at cleanup (60 s by default)


async def drain(forwarder: Forwarder, deadline: float, grace_s: float) -> None:
    """Refuse new requests, let open exchanges finish until `deadline`, then end the rest visibly
    and give their handlers END_WAIT_S to write the end and the record."""
    forwarder.refuse_new()
    if forwarder.active:
        _log.info("draining", open_exchanges=len(forwarder.active), grace_s=grace_s)
    while forwarder.active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if forwarder.active:
        _log.warning("ending_open_exchanges", open_exchanges=len(forwarder.active),
                     note="the shutdown grace ran out: each ends with a proxy_shutdown event and record")
        forwarder.end_active()
        wait_until = time.monotonic() + END_WAIT_S
        while forwarder.active and time.monotonic() < wait_until:
            await asyncio.sleep(0.02)


def proxy_application(config: ProxyConfig, observers: ObserverChain, concurrency: InFlightTracker,
                      budget: ByteBudget, check: ServerCheck | None = None,
                      on_refused: Callable[[str], None] = lambda reason: None) -> Forwarder:
    """The forwarding path: its `handle` answers every request on the proxy port (see `listen`).
    Its owner closes it (`Forwarder.close`: its pool of upstream connections)."""
    return Forwarder(config, observers, concurrency, budget, check, on_refused)


def server_check(config: ProxyConfig, deliver: Callable[[ResponseRecord], None], on_result: Callable[[str], None],
                 ) -> ServerCheck:
    """What the proxy asks its upstream after each response (this process's share of the limits).
    `--upstream-metrics off` means the proxy sends its upstream nothing but the clients' requests:
    no probe of what server it is, no tokenizer call."""
    asks = config.upstream_metrics != "off"
    return open_server_check(config.upstream, config.upstream_authorization, deliver, probe=asks,
                             tokenizer=asks and config.server_tokenizer, limits=CheckLimits().share(config.workers),
                             on_result=on_result)


def open_history(config: ProxyConfig, metrics: ProxyMetrics) -> History | None:
    """The history database named by the config, its writer started; None when off. One that
    cannot be opened is logged and stays down (`llm_proxy_history_up 0`): the proxy serves anyway."""
    if config.history_path is None:
        metrics.history_up.set(0)
        return None
    history = History(config.history_path, max_age_s=config.history_max_age_s, max_bytes=config.history_max_bytes,
                      metrics=metrics)
    history.open()
    return history


def open_tracer(config: ProxyConfig, metrics: ProxyMetrics) -> Tracer | None:
    """The OpenTelemetry exporter when `--otel` asks for it (TracingUnavailable without the SDK)."""
    if not config.otel:
        return None
    from proxy.tracing import Tracer

    return Tracer(config.upstream, metrics)


def exporting_chain(config: ProxyConfig, metrics: ProxyMetrics, telemetry: Telemetry, store: RecordStore, *,
                    extra_observers: tuple[object, ...] = (), log_records: bool | None = None,
                    history: History | None = None, tracer: Tracer | None = None) -> ObserverChain:
    """The observers of finished records, in order: the telemetry enricher first (what it adds
    is exported below), then metrics, the JSON log line, the record store and the history."""
    chain = ObserverChain()
    chain.add(telemetry.observer)
    for observer in extra_observers:
        chain.add(observer)
    chain.add(MetricsObserver(metrics))
    if config.log_records if log_records is None else log_records:
        chain.add(LogObserver(config.upstream))
    chain.add(store)
    for exporter in (history, tracer):
        if exporter is not None:
            chain.add(exporter)
    return chain


@dataclass
class RunningProxy:
    """A started proxy: its two listeners, its record store and metrics."""

    config: ProxyConfig
    proxy_url: str
    admin_url: str
    store: RecordStore
    metrics: ProxyMetrics
    concurrency: InFlightTracker
    observers: ObserverChain
    forwarder: Forwarder
    _runners: list[web.BaseRunner] = field(default_factory=list)
    _proxy_site: web.TCPSite | None = None
    _session: aiohttp.ClientSession | None = None
    _telemetry: Telemetry | None = None
    history: History | None = None
    tracer: Tracer | None = None
    check: ServerCheck | None = None
    readers: AdminReaders = field(default_factory=AdminReaders)
    _closed: bool = False

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
        if self.check is not None:  # after the handlers: their last records may wait on the tokenizer
            await self.check.close()
        if self._telemetry is not None:
            await self._telemetry.stop()
        if self.history is not None:
            await asyncio.to_thread(self.history.close)
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.close)
        await self.forwarder.close()
        if self._session is not None:
            await self._session.close()


async def start_proxy(config: ProxyConfig, *, extra_observers: tuple[object, ...] = (),
                      log_records: bool | None = None) -> RunningProxy:
    """Start both listeners (port 0 picks a free port) and return once they accept connections."""
    metrics = ProxyMetrics(max_models=config.max_models)
    store = RecordStore(config.ring_size)
    telemetry = Telemetry(config, metrics)
    tracer = open_tracer(config, metrics)
    history = open_history(config, metrics)
    chain = exporting_chain(config, metrics, telemetry, store, extra_observers=extra_observers,
                            log_records=log_records, history=history, tracer=tracer)
    session = upstream_session(config)
    concurrency = InFlightTracker()
    budget = ByteBudget(config.parse_budget_bytes)
    metrics.read_state(in_flight=lambda: concurrency.in_flight, parse_budget_used=lambda: budget.used,
                       parse_budget_refusals=lambda: budget.refused)
    check = server_check(config, chain.response_finished, metrics.count_tokenizer)
    forwarder = proxy_application(config, chain, concurrency, budget, check, metrics.count_refused)
    probe = UpstreamProbe(config.upstream, session, config.upstream_authorization)
    readers = AdminReaders()
    admin_app = build_admin_app(store, metrics, probe, config.admin_token, ready=lambda: not forwarder.shutting_down,
                                history=history, allowed_hosts=config.admin_allowed_hosts, readers=readers)
    running = RunningProxy(config, "", "", store, metrics, concurrency, chain, forwarder, _session=session,
                           _telemetry=telemetry, history=history, tracer=tracer, check=check, readers=readers)
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
        await telemetry.start()
        check.start()
    except BaseException:
        await running.close()
        raise
    return running


def serve_forever(config: ProxyConfig) -> int:
    """Run the proxy until SIGINT/SIGTERM; returns the exit code."""
    configure_logging(config.log_level, config.log_format)
    if config.workers > 1:
        from proxy.workers import serve_workers

        return serve_workers(config)
    try:
        return run_loop(_serve(config))
    except KeyboardInterrupt:
        return 0


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to its end on uvloop, or on asyncio's own loop where uvloop is not built."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


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
              deadline_mode=config.deadline_mode, shutdown_grace_s=config.shutdown_grace_s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        _log.info("stopping", shutdown_grace_s=config.shutdown_grace_s)
        took = await running.shutdown(config.shutdown_grace_s)
        _log.info("stopped", seconds=round(took, 3))
    return 0
