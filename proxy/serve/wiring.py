"""What one process and the supervisor of N workers both build: the forwarding path, the server
check, the history, the tracer, the chain of observers, the upstream session, and the shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import structlog
from aiohttp import web

from proxy.config import ProxyConfig
from proxy.diagnosis.delivery import Delivery
from proxy.diagnosis.server_check import ServerCheck, open_server_check
from proxy.diagnosis.tokenizer_queue import CallGate, QueueLimits
from proxy.observers.history import History
from proxy.observers.hooks import Observer
from proxy.observers.logs import LogObserver
from proxy.observers.metrics import MetricsObserver, ProxyMetrics
from proxy.observers.record_store import RecordStore
from proxy.observers.telemetry import Telemetry
from proxy.observers.tracing import Tracer
from proxy.record import ResponseRecord
from proxy.relay.forward import Forwarder
from proxy.relay.in_flight import InFlightTracker
from proxy.relay.upstream.pool import POOLED_IDLE_S
from proxy.serve.admin import UpstreamProbe, build_admin_app
from proxy.serve.admin_reads import AdminReaders
from proxy.wire.byte_budget import ByteBudget
from proxy.wire.server_facts import ServerFacts

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


def proxy_application(config: ProxyConfig, observers: Delivery, concurrency: InFlightTracker,
                      budget: ByteBudget, check: ServerCheck | None = None,
                      on_refused: Callable[[str], None] = lambda reason: None) -> Forwarder:
    """The forwarding path: its `handle` answers every request on the proxy port (see `listen`).
    Its owner closes it (`Forwarder.close`: its pool of upstream connections)."""
    return Forwarder(config, observers, concurrency, budget, check, on_refused)


def server_check(config: ProxyConfig, deliver: Callable[[ResponseRecord], None], on_result: Callable[[str], None],
                 on_models: Callable[[Iterable[str]], None] = lambda names: None,
                 on_lost: Callable[[], None] = lambda: None, gate: CallGate | None = None) -> ServerCheck:
    """What the proxy asks its upstream after each response (this process's share of the limits).
    `--upstream-metrics off` means the proxy sends its upstream nothing but the clients' requests:
    no probe of what server it is, no tokenizer call."""
    asks = config.upstream_metrics != "off"
    return open_server_check(config.upstream, config.upstream_authorization, deliver, probe=asks,
                             tokenizer=asks and config.server_tokenizer, limits=QueueLimits().share(config.workers),
                             on_result=on_result, on_models=on_models, on_lost=on_lost, gate=gate)


def open_history(config: ProxyConfig, metrics: ProxyMetrics) -> History | None:
    """The history database named by the config, its writer started; None when off. One that
    cannot be opened is logged and down (`llm_proxy_history_up 0`; a database server is tried
    again in the background): the proxy serves anyway."""
    if config.history_path is None:
        metrics.history_up.set(0)
        return None
    history = History(config.history_path, max_age_s=config.history_max_age_s, max_bytes=config.history_max_bytes,
                      metrics=metrics, password=config.history_password, buffer=config.history_buffer)
    history.open()
    return history


def about(config: ProxyConfig, proxy_url: Callable[[], str], admin_url: Callable[[], str],
          facts: Callable[[], ServerFacts]) -> Callable[[], dict[str, Any]]:
    """`/api/about`'s answer: this proxy's addresses, its name on records, its upstream and what the
    upstream says of itself."""

    def answer() -> dict[str, Any]:
        return {"proxy": {"url": reachable_url(proxy_url()), "admin": reachable_url(admin_url()),
                          "instance": config.instance, "upstream": config.upstream, "workers": config.workers},
                "server": facts().to_dict()}

    return answer


def reachable_url(url: str) -> str:
    """A listening URL as a client on this machine reaches it: a wildcard host (0.0.0.0, [::]) is loopback."""
    return url.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//[::1]:")


def history_shown(config: ProxyConfig) -> str:
    """Where the records go, as the log may say it (a URL's password hidden)."""
    from proxy.observers.history.source import shown

    return "off" if config.history_path is None else shown(config.history_path)


def open_tracer(config: ProxyConfig, metrics: ProxyMetrics) -> Tracer | None:
    """The OpenTelemetry exporter when `--otel` asks for it (TracingUnavailable without the SDK)."""
    if not config.otel:
        return None
    from proxy.observers.tracing import Tracer

    return Tracer(config.upstream, metrics)


@dataclass
class Observing:
    """All that finished records reach in the process that keeps them (one process, or the
    supervisor of N workers): metrics, the store, telemetry, history, spans, and their chain."""

    metrics: ProxyMetrics
    store: RecordStore
    telemetry: Telemetry
    history: History | None
    tracer: Tracer | None
    delivery: Delivery

    @classmethod
    def open(cls, config: ProxyConfig, *, extra_observers: tuple[Observer, ...] = (),
             log_records: bool | None = None) -> Observing:
        """Built from the config (TracingUnavailable when `--otel` asks for an SDK not installed)."""
        metrics = ProxyMetrics(max_models=config.max_models, max_clients=config.client_metrics)
        store = RecordStore(config.ring_size)
        telemetry = Telemetry(config, metrics)
        tracer = open_tracer(config, metrics)
        history = open_history(config, metrics)
        delivery = default_observers(config, metrics, telemetry, store, extra_observers=extra_observers,
                                     log_records=log_records, history=history, tracer=tracer)
        return cls(metrics, store, telemetry, history, tracer, delivery)

    def admin(self, config: ProxyConfig, session: aiohttp.ClientSession, ready: Callable[[], bool],
              readers: AdminReaders | None = None,
              about: Callable[[], dict[str, Any]] | None = None) -> web.Application:
        """The admin listener's application over these records (each answer after the records
        waiting for their batch are delivered)."""
        probe = UpstreamProbe(config.upstream, session, config.upstream_authorization)
        return build_admin_app(self.store, self.metrics, probe, config.admin_token, ready=ready,
                               history=self.history, allowed_hosts=config.admin_allowed_hosts, readers=readers,
                               instance=config.instance, before_read=self.delivery.flush, about=about)

    async def close(self) -> None:
        """Deliver the records still waiting for their batch; stop the pollers; write what the
        history and the span exporter still hold."""
        self.delivery.flush()
        await self.telemetry.stop()
        if self.history is not None:
            await asyncio.to_thread(self.history.close)
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.close)


# The longest a finished record waits to be delivered with others (`proxy.diagnosis.delivery`): a
# log line a tenth of a second late, never a record missing from what the admin listener answers.
DELIVERY_BATCH_S = 0.1


def default_observers(config: ProxyConfig, metrics: ProxyMetrics, telemetry: Telemetry, store: RecordStore, *,
                      extra_observers: tuple[Observer, ...] = (), log_records: bool | None = None,
                      history: History | None = None, tracer: Tracer | None = None) -> Delivery:
    """The chain, declared in one list: the telemetry's enricher first (its facts reach every
    exporter), then metrics, the JSON log line, the record store, the history and the spans."""
    observers: list[Observer] = [*extra_observers, MetricsObserver(metrics)]
    if config.log_records if log_records is None else log_records:
        observers.append(LogObserver(config.upstream))
    observers.append(store)
    observers.extend(exporter for exporter in (history, tracer) if exporter is not None)
    return Delivery(observers, enrichers=[telemetry.enricher], batch_s=DELIVERY_BATCH_S,
                    on_lost=metrics.records_lost.inc)


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to its end on uvloop, or on asyncio's own loop where uvloop is not built."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def until_stopped(*others: Coroutine[Any, Any, Any]) -> None:
    """Wait for SIGINT or SIGTERM, or for the first of `others` to end."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    waits = [asyncio.ensure_future(stop.wait()), *(asyncio.ensure_future(other) for other in others)]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


def upstream_session(config: ProxyConfig) -> aiohttp.ClientSession:
    """An aiohttp session for the proxy's own requests to the upstream (the admin's probe, the
    server's /metrics): no decompression, no cookie jar, no proxy settings from the environment."""
    return aiohttp.ClientSession(
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        trust_env=False,
        timeout=aiohttp.ClientTimeout(total=None, connect=config.connect_timeout_s, sock_read=None),
        connector=aiohttp.TCPConnector(keepalive_timeout=POOLED_IDLE_S),
    )
