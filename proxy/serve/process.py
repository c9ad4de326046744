"""The one build of a serving process: what answers the proxy port and makes every record.

`ServingProcess.open` builds it all (hypercorn's `worker_func`): the forwarding path, the in-flight
counts and the bytes held for parsing, the server check (its identity poller and its share of the
tokenizer), the delivery and its observers (metrics, the log line, the record store, the history,
the spans). A proxy in one process runs it once, beside its admin listener (`proxy.serve.app`);
`--workers N` runs it in each of N processes, with the shared state from the supervisor
(`proxy.serve.workers`). Nothing below `serve/` knows which.

`LocalRecords` is what the admin listener reads of one serving process: in one process directly,
in a worker through its link to the supervisor.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog
from aiohttp import web

from proxy.config import ProxyConfig
from proxy.diagnosis.delivery import Delivery
from proxy.diagnosis.finish import Finisher
from proxy.diagnosis.server_check import ServerCheck, open_server_check
from proxy.diagnosis.server_traces import TraceJoin, TraceLimits
from proxy.diagnosis.tokenizer_queue import CallGate, QueueLimits
from proxy.observers.history import History, HistorySource
from proxy.observers.hooks import Enricher, Observer
from proxy.observers.logs import LogObserver
from proxy.observers.metrics import MetricsObserver, RecordMetrics
from proxy.observers.record_store import RecordQuery, RecordStore, matching
from proxy.observers.tracing import Tracer
from proxy.record import CompactOnce
from proxy.relay.admission import AdmissionGate, GateSettings
from proxy.relay.deadlines import calibrate
from proxy.relay.forward import Forwarder
from proxy.relay.in_flight import InFlightTracker
from proxy.relay.listeners import listen
from proxy.serve.messages import PageFound
from proxy.serve.shared import HANDED, KEPT, Ledger, LedgerObserver, SharedState
from proxy.wire.parse_bytes import ParseBytes

_log = structlog.get_logger("llm_diag_proxy")
# The longest a finished record waits to be delivered with others (`proxy.diagnosis.delivery`;
# a batch goes sooner once 64 wait): a log line or a metric at most half a second late, never a
# record missing from what the admin listener answers (every read of it delivers what waits first).
# At 32 paced streams, side by side in 30 s rounds against 0.1 s: 0.25 s 2.9 % less CPU per event,
# 0.5 s 4.7 %, 1 s 4.6 % (records made and observed back to back, warm; docs/overhead.md, tenth pass).
DELIVERY_BATCH_S = 0.5
# After the grace, the streams still open are ended at once; their handlers then need a moment to
# write the end to the client and the record to the observers.
END_WAIT_S = 2.0
RUNNER_SHUTDOWN_S = 1.0  # what aiohttp gives its own handlers at cleanup (60 s by default)
JSON_BATCH = 50  # records serialised between two turns of the loop


@dataclass
class ServingProcess:
    """Everything one serving process holds. `owner` is its slot in the shared state (0: alone)."""

    config: ProxyConfig
    owner: int
    metrics: RecordMetrics
    store: RecordStore
    history: History | None
    tracer: Tracer | None
    delivery: Delivery
    check: ServerCheck
    forwarder: Forwarder
    concurrency: InFlightTracker
    parse_bytes: ParseBytes
    traces: TraceJoin | None = None  # the server's request spans, joined to the records (--server-traces)
    url: str = ""
    runner: web.BaseRunner | None = None
    _site: web.TCPSite | None = None
    _closed: bool = field(default=False, repr=False)

    @classmethod
    def open(cls, config: ProxyConfig, metrics: RecordMetrics, enricher: Enricher, *, owner: int = 0,
             shared: SharedState | None = None, extra_observers: tuple[Observer, ...] = (),
             log_records: bool | None = None) -> ServingProcess:
        """Built from the config, inside the event loop that will run it (TracingUnavailable when
        `--otel` asks for an SDK that is not installed). With `shared`, this is worker `owner - 1`
        of `config.workers`: the counts, the bytes held for parsing and the tokenizer's gate are the
        whole proxy's, and its bounded buffers (the ring, the history's buffer, the tokenizer's
        queue) are its share of the proxy's."""
        workers = config.workers if shared is not None else 1
        compact = CompactOnce()
        ledger = Ledger(shared.ledger, owner) if shared is not None else None
        store = RecordStore(max(1, config.ring_size // workers), owner)
        tracer = open_tracer(config, metrics)
        history = open_history(config, metrics, workers, retains=owner <= 1, compact=compact, ledger=ledger)
        observers: list[Observer] = [*extra_observers, MetricsObserver(metrics)]
        if config.log_records if log_records is None else log_records:
            observers.append(LogObserver(config.upstream, compact))
        observers.append(store)
        observers.extend(exporter for exporter in (history, tracer) if exporter is not None)
        if ledger is not None:
            observers.append(LedgerObserver(ledger))
        delivery = Delivery(observers, enrichers=[enricher], batch_s=DELIVERY_BATCH_S,
                            on_lost=metrics.records_lost.inc, compact=compact)
        concurrency = InFlightTracker(counts=shared.counts if shared is not None else None, owner=owner)
        parse_bytes = ParseBytes(config.parse_bytes_max, shared=shared.parse_bytes if shared is not None else None,
                                 owner=owner)
        gate = CallGate(shared=shared.gate, owner=owner) if shared is not None else None
        check = server_check(config, delivery.response_finished, metrics.count_tokenizer, metrics.know_models,
                             metrics.records_lost.inc, gate=gate, workers=workers)
        finisher = Finisher(delivery, check)
        if config.server_traces:
            # With N workers every worker hears every span: only its own records' are joined, and a span
            # none of them knew is not counted unmatched N times (not at all).
            limits = TraceLimits(wait_s=config.server_traces_wait_s).share(workers)
            finisher.traces = TraceJoin(finisher.checked, limits, metrics.count_spans,
                                        count_unmatched=shared is None)
        admission = AdmissionGate(GateSettings(config.max_in_flight, config.queue_max, config.queue_timeout_s)) \
            if shared is None else None  # (the gate needs one process: its queue is not shared)
        forwarder = Forwarder(config, finisher, concurrency, parse_bytes, metrics.count_refused, admission,
                              metrics.count_not_admitted)
        return cls(config, owner, metrics, store, history, tracer, delivery, check, forwarder, concurrency,
                   parse_bytes, finisher.traces)

    async def listen(self, *, reuse_port: bool = False) -> str:
        """Open the proxy port (with `reuse_port`, the port N workers share) and start the server
        check; returns the URL it listens on."""
        config = self.config
        calibrate(asyncio.get_running_loop())  # (the deadlines' clock, read while the loop is idle)
        # handler_cancellation: a client that goes away cancels its handler at once, so the
        # upstream request is cancelled too (the server frees the sequence's KV blocks).
        self.runner, self._site, self.url = await listen(
            self.forwarder.handle, config.listen, backlog=config.backlog, header_timeout_s=config.header_timeout_s,
            on_refused=self.metrics.count_refused, shutdown_timeout=RUNNER_SHUTDOWN_S, handler_cancellation=True,
            reuse_port=reuse_port)
        self.check.start()
        return self.url

    async def stop(self, grace_s: float) -> None:
        """Close the port (new connections are refused), let open exchanges finish for up to
        `grace_s`, end the rest visibly (`proxy_shutdown`), then `close`."""
        started = time.monotonic()
        if self._site is not None:
            await self._site.stop()
            self._site = None
        await drain(self.forwarder, started + grace_s, grace_s)
        await self.close()

    async def close(self) -> None:
        """End what is still open, write every record, and close what was opened (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.forwarder.refuse_new()
        self.forwarder.end_active()
        if self.runner is not None:
            await self.runner.cleanup()
        self.delivery.flush()  # the handlers' last finishes, before the spans' join and the tokenizer close
        if self.traces is not None:
            self.traces.close()  # the records waiting for a span go on without one
        await self.check.close()  # after the handlers: their last records may wait on the tokenizer
        self.delivery.flush()
        if self.history is not None:
            await asyncio.to_thread(self.history.close)
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.close)
        await self.forwarder.close()


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


def server_check(config: ProxyConfig, deliver: Callable[..., None], on_result: Callable[[str], None],
                 on_models: Callable[[Iterable[str]], None] = lambda names: None,
                 on_lost: Callable[[], None] = lambda: None, gate: CallGate | None = None,
                 workers: int = 1) -> ServerCheck:
    """What the proxy asks its upstream after each response (this process's share of the limits).
    `--upstream-metrics off` means the proxy sends its upstream nothing but the clients' requests:
    no question of what server it is, no tokenizer call."""
    asks = config.upstream_metrics != "off"
    return open_server_check(config.upstream, config.upstream_authorization, deliver, identify=asks,
                             tokenizer=asks and config.server_tokenizer, limits=QueueLimits().share(workers),
                             on_result=on_result, on_models=on_models, on_lost=on_lost, gate=gate)


def open_history(config: ProxyConfig, metrics: RecordMetrics, workers: int = 1, *, retains: bool = True,
                 compact: CompactOnce | None = None, ledger: Ledger | None = None) -> History | None:
    """The history database named by the config, its writer started; None when off. One that
    cannot be opened is logged and down (`llm_proxy_history_up 0`; a database server is tried
    again in the background): the proxy serves anyway. N workers write it each (SQLite in WAL mode
    takes several writers, each waiting its turn; PostgreSQL does too), each with its share of the
    buffer, and one of them applies the retention."""
    if config.history_path is None:
        metrics.history_up.set(0)
        return None
    on_handed: Callable[[], None] = lambda: None  # noqa: E731
    on_kept: Callable[[int], None] = lambda count: None  # noqa: E731
    if ledger is not None:
        on_handed, on_kept = (lambda: ledger.add(HANDED)), (lambda count: ledger.add(KEPT, count))
    history = History(config.history_path, max_age_s=config.history_max_age_s, max_bytes=config.history_max_bytes,
                      metrics=metrics, password=config.history_password,
                      buffer=max(1, config.history_buffer // workers), retains=retains, compact=compact,
                      on_handed=on_handed, on_kept=on_kept)
    history.open()
    return history


def open_tracer(config: ProxyConfig, metrics: RecordMetrics) -> Tracer | None:
    """The OpenTelemetry exporter when `--otel` asks for it (TracingUnavailable without the SDK)."""
    if not config.otel:
        return None
    return Tracer(config.upstream, metrics)


class LocalRecords:
    """What the admin listener reads of one serving process: its records, delivered first."""

    def __init__(self, process: ServingProcess) -> None:
        self._process = process

    @property
    def history(self) -> History | None:
        return self._process.history

    @property
    def history_source(self) -> HistorySource | None:
        history = self._process.history
        return None if history is None else history.source

    async def refresh_metrics(self) -> None:
        """The metrics of every record delivered: those waiting for their batch are delivered now."""
        self.deliver()

    def deliver(self) -> None:
        """Deliver what waits for its batch (before anything the observers keep is read)."""
        self._process.delivery.flush()

    async def settle(self) -> bool | None:
        """What ended before this call is in the ring and handed to the history, and the history
        wrote it (bounded); whether the history is up (None: none is kept)."""
        self.deliver()
        history = self._process.history
        if history is None:
            return None
        if history.up:
            await asyncio.to_thread(history.settle)
        return history.up

    async def page(self, query: RecordQuery) -> PageFound:
        """The newest matching records of the ring older than the cursor, each with its number and
        its JSON (found in a thread over a copy, serialised a batch at a time)."""
        self.deliver()
        store = self._process.store
        snapshot = store.snapshot()
        found = await asyncio.to_thread(_first, snapshot, query)
        more = len(found) > query.limit
        found = found[:query.limit]
        bodies = await json_each([record for _, record in found])
        return PageFound([(seq, body) for (seq, _), body in zip(found, bodies, strict=True)], more, len(store),
                         store.capacity)

    async def get(self, request_id: str) -> bytes | None:
        self.deliver()
        record = self._process.store.get(request_id)
        return None if record is None else orjson.dumps(record.to_dict(), default=str)

    async def ring(self, query: RecordQuery) -> list[bytes]:
        """Every matching record of the ring, as JSON arrays of JSON_BATCH records each."""
        self.deliver()
        records = [record for _, record in self._process.store.snapshot() if query.matches(record)]
        arrays = []
        for start in range(0, len(records), JSON_BATCH):
            arrays.append(orjson.dumps([r.to_dict() for r in records[start:start + JSON_BATCH]], default=str))
            await asyncio.sleep(0)
        return arrays


def _first(ring: list[Any], query: RecordQuery) -> list[Any]:
    """The first `limit + 1` matches (one more tells whether there are more)."""
    found = []
    for entry in matching(ring, query):
        found.append(entry)
        if len(found) > query.limit:
            break
    return found


async def json_each(records: list[Any]) -> list[bytes]:
    """Each record's JSON, JSON_BATCH between two turns of the loop."""
    bodies: list[bytes] = []
    for start in range(0, len(records), JSON_BATCH):
        bodies.extend(orjson.dumps(r.to_dict(), default=str) for r in records[start:start + JSON_BATCH])
        await asyncio.sleep(0)
    return bodies

