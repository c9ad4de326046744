"""`--workers N`: the serving process (`proxy.serve.process`) run in each of N processes, on one port,
and a supervisor that supervises them and serves the admin listener.

Each worker is what one process is: its own event loop, listener, upstream pool, server check, and
observers (metrics in its own registry, its log lines, its ring of records, its history writer,
its spans). Every worker binds the port with SO_REUSEPORT and the kernel spreads new connections
over them. What must stay proxy-wide is in shared memory (`proxy.serve.shared`): the in-flight
counts behind every concurrency figure, the bytes held for parsing, the tokenizer's gate, and each
worker's ledger.

The supervisor does no work per record. It polls NVML and the upstream's own state once and tells
the workers each sample (their records' telemetry); it asks the workers, over each one's link
(`proxy.serve.messages`), for what someone reads of its admin listener: `/metrics` is every
worker's registry summed (`proxy.observers.metrics_merge`), `/api/requests` reads the history
once every worker has written what ended before it (else their rings, merged by sequence number:
newest first, none twice), `/api/diagnose` the same.

A worker that dies is started again (at most RESTARTS_PER_MINUTE a minute; past that the proxy
stops with exit code 1 rather than serve at a fraction of itself). What it held goes back at once
(its requests in flight, its bytes held for parsing, its tokenizer calls); its ledger says the
records it took with it (`llm_proxy_records_lost_total`), and its counts go on in the sum from its
last snapshot (each worker sends one at most once a second when it has delivered records since).
On SIGTERM the supervisor passes it on, waits for every worker to drain, write its records and
send its last snapshot, then stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import pickle
import secrets
import signal
import socket
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

import aiohttp
import structlog

from proxy.config import HostPort, ProxyConfig
from proxy.diagnosis.tokenizer_queue import CallGate
from proxy.observers.history import HistorySource
from proxy.observers.logs import configure_logging
from proxy.observers.metrics import ProcessMetrics, RecordMetrics
from proxy.observers.metrics_merge import MergedMetrics, snapshot
from proxy.observers.record_store import RecordQuery
from proxy.observers.telemetry import Telemetry
from proxy.observers.telemetry.service import TelemetryRings
from proxy.observers.tracing import Tracer, TracingUnavailable
from proxy.processes import follow_parent
from proxy.relay.in_flight import InFlightTracker
from proxy.relay.listeners import listen
from proxy.serve.admin import UpstreamReachability, build_admin_app
from proxy.serve.admin_reads import AdminReaders
from proxy.serve.messages import (
    Link,
    LinkClosed,
    Listening,
    MetricsAsked,
    MetricsSnapshot,
    PageAsked,
    PageFound,
    RecordAsked,
    RecordFound,
    RingAsked,
    RingFound,
    ServerSpans,
    Settle,
    Settled,
    TelemetrySamples,
)
from proxy.serve.process import END_WAIT_S, RUNNER_SHUTDOWN_S, LocalRecords, ServingProcess
from proxy.serve.shared import DELIVERED, OPEN, Ledger, SharedState
from proxy.serve.trace_receiver import TraceReceiver
from proxy.serve.wiring import about, history_shown, open_files, run_loop, settle_heap, until_stopped, upstream_session
from proxy.servers.base import UNKNOWN_SERVER
from proxy.servers.identity import IdentityPoller
from proxy.wire.parse_bytes import ParseBytes

_log = structlog.get_logger("llm_diag_proxy")
START_TIMEOUT_S = 60.0
RESTARTS_PER_MINUTE = 5
LINK_WAIT_S = 5.0  # how long a dead worker's link may take to give up its last messages
SNAPSHOT_EVERY_S = 1.0  # a worker's metrics, sent at most this often while it delivers records
SAMPLES_ON_START = 8  # the newest telemetry samples a (re)started worker is given


# --- the worker side -------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerArgs:
    """What a worker process is started with (pickled to it)."""

    index: int
    config: ProxyConfig
    shared: SharedState
    supervisor: int  # the supervisor's pid: a worker does not outlive it
    link: Connection  # its end of the socket pair to the supervisor

    @property
    def owner(self) -> int:
        """Its slot in the shared state (0 is a single process's)."""
        return self.index + 1


def worker_main(args: WorkerArgs) -> None:
    """The entry point of a worker process."""
    follow_parent(args.supervisor)  # no worker keeps the port open with no one supervising it
    configure_logging(args.config.log_level, args.config.log_format)
    structlog.contextvars.bind_contextvars(worker=args.index)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the supervisor, which says when
    run_loop(_worker(args))


class WorkerAnswers:
    """What a worker answers its supervisor: its records (`LocalRecords`) and its metrics."""

    def __init__(self, serving: ServingProcess, ledger: Ledger) -> None:
        self.records = LocalRecords(serving)
        self._serving = serving
        self._ledger = ledger

    def snapshot(self) -> MetricsSnapshot:
        self.records.deliver()
        delivered = self._ledger[DELIVERED]
        families = pickle.dumps(snapshot(self._serving.metrics.registry), protocol=pickle.HIGHEST_PROTOCOL)
        return MetricsSnapshot(families, delivered)

    async def answer(self, question: Any) -> Any:
        records = self.records
        if isinstance(question, Settle):
            return Settled(await records.settle())
        if isinstance(question, PageAsked):
            return await records.page(question.query)
        if isinstance(question, RecordAsked):
            return RecordFound(await records.get(question.request_id))
        if isinstance(question, RingAsked):
            return RingFound(await records.ring(question.query))
        if isinstance(question, MetricsAsked):
            return self.snapshot()
        raise ValueError(f"no answer to {type(question).__name__}")


async def _worker(args: WorkerArgs) -> None:
    config = args.config
    loop = asyncio.get_running_loop()
    sock = socket.socket(fileno=os.dup(args.link.fileno()))
    args.link.close()
    rings = TelemetryRings(config)
    metrics = RecordMetrics(max_models=config.max_models, max_clients=config.client_metrics)
    serving = ServingProcess.open(config, metrics, rings.enricher, owner=args.owner, shared=args.shared)
    ledger = Ledger(args.shared.ledger, args.owner)
    answers = WorkerAnswers(serving, ledger)

    def told(message: Any) -> None:
        if isinstance(message, TelemetrySamples):
            rings.receive(message.gpu, message.upstream, message.pids)
        elif isinstance(message, ServerSpans) and serving.traces is not None:
            serving.traces.receive(list(message.spans))

    link = Link(told, answers.answer)
    await loop.connect_accepted_socket(lambda: link, sock)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    url = await serving.listen(reuse_port=True)
    settle_heap()
    link.tell(Listening(url, os.getpid()))
    sender = loop.create_task(_send_snapshots(link, answers, ledger), name="metrics-snapshots")
    await stop.wait()
    await serving.stop(config.shutdown_grace_s)
    sender.cancel()
    link.tell(answers.snapshot(), always=True)  # its last counts: the sum goes on from them
    await link.drain(END_WAIT_S)
    link.close()


async def _send_snapshots(link: Link, answers: WorkerAnswers, ledger: Ledger) -> None:
    """The worker's metrics, at most every SNAPSHOT_EVERY_S while records are delivered: what the
    sum keeps if this worker dies before the next scrape asks."""
    sent = 0
    while True:
        await asyncio.sleep(SNAPSHOT_EVERY_S)
        if ledger[DELIVERED] != sent:
            message = answers.snapshot()
            sent = message.delivered
            link.tell(message)


# --- the supervisor --------------------------------------------------------------------------
class WorkerFailed(Exception):
    """A worker could not start, or kept dying."""


class Worker:
    """One worker process as the supervisor sees it (a restart is a new one in the same slot)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: Any = None
        self.url: str | None = None
        self.listening = asyncio.Event()
        self.link: Link | None = None
        self.snapshot: MetricsSnapshot | None = None  # its newest metrics, kept as they came

    @property
    def key(self) -> int:
        """Its process's own key in the sum of the metrics (its pid: a restart's counts start anew)."""
        return int(self.process.pid) if self.process is not None else -1 - self.index

    @property
    def owner(self) -> int:
        return self.index + 1

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()


class WorkerSupervisor:
    """Starts, watches, restarts and stops the workers; tells them the telemetry; gives back what a
    worker that died held and counts the records it took with it. `merged` is the workers' metrics
    summed (and `own`, what the supervisor itself counts: its admin listener's refusals, the records
    dead workers took)."""

    def __init__(self, config: ProxyConfig, shared: SharedState, merged: MergedMetrics, own: RecordMetrics,
                 process_metrics: ProcessMetrics) -> None:
        self._context = multiprocessing.get_context("spawn")
        self.config = config
        self._shared = shared
        self.merged = merged
        self.own = own
        self._process_metrics = process_metrics
        self._tracker = InFlightTracker(counts=shared.counts)
        self._bytes = ParseBytes(config.parse_bytes_max, shared=shared.parse_bytes)
        self._gate = CallGate(shared=shared.gate)
        self.workers = [Worker(i) for i in range(config.workers)]  # the current process of each slot
        self.stopping = False
        self.failed = asyncio.Event()
        self._restarts: list[float] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._telemetry: Telemetry | None = None
        self._samples: dict[str, list[tuple[float, Any]]] = {"gpu": [], "upstream": []}

    @property
    def alive(self) -> int:
        return sum(1 for w in self.workers if w.alive)

    @property
    def ready(self) -> bool:
        """The proxy port accepts: some worker is alive and listening on it, and none is stopping."""
        return not self.stopping and any(w.listening.is_set() and w.alive for w in self.workers)

    def links(self) -> list[tuple[Worker, Link]]:
        return [(w, w.link) for w in self.workers if w.link is not None and not w.link.closed.is_set()]

    # --- telemetry, told to every worker ------------------------------------------------------
    def follow(self, telemetry: Telemetry) -> None:
        """Pass every sample the supervisor's pollers keep on to the workers (one message per turn)."""
        self._telemetry = telemetry
        for name, ring in (("gpu", telemetry.gpu_ring), ("upstream", telemetry.upstream_ring)):
            if ring is not None:
                ring.on_append = lambda t, sample, name=name: self._sampled(name, t, sample)
        telemetry.on_pids = lambda pids: self._tell_all(TelemetrySamples(pids=pids))

    def _sampled(self, name: str, t: float, sample: Any) -> None:
        if not any(self._samples.values()):
            asyncio.get_running_loop().call_soon(self._tell_samples)
        self._samples[name].append((t, sample))

    def _tell_samples(self) -> None:
        gpu, upstream = tuple(self._samples["gpu"]), tuple(self._samples["upstream"])
        self._samples = {"gpu": [], "upstream": []}
        self._tell_all(TelemetrySamples(gpu, upstream))

    def tell_all(self, message: Any) -> None:
        """One message to every live worker."""
        self._tell_all(message)

    def _tell_all(self, message: Any) -> None:
        for _, link in self.links():
            link.tell(message)

    def _recent_samples(self) -> TelemetrySamples:
        telemetry = self._telemetry
        if telemetry is None:
            return TelemetrySamples()
        rings = telemetry.rings
        gpu = rings.gpu.newest(SAMPLES_ON_START) if rings.gpu is not None else []
        upstream = rings.upstream.newest(SAMPLES_ON_START) if rings.upstream is not None else []
        return TelemetrySamples(tuple(gpu), tuple(upstream), rings.pids)

    # --- the metrics, summed --------------------------------------------------------------------
    async def refresh_metrics(self) -> None:
        """Every live worker's snapshot (a worker that does not answer in time keeps its last), and
        the supervisor's own counts; all of it into the sum."""
        asked = self.links()
        found = await asyncio.gather(*(link.ask(MetricsAsked()) for _, link in asked), return_exceptions=True)
        for (worker, _), answer in zip(asked, found, strict=True):
            if isinstance(answer, MetricsSnapshot):
                worker.snapshot = answer
        for worker in self.workers:
            if worker.snapshot is not None:
                self.merged.update(worker.key, pickle.loads(worker.snapshot.families))
        self.merged.update(0, [family for family in snapshot(self.own.registry) if family["type"] != "gauge"])

    # --- starting and watching ------------------------------------------------------------------
    async def start(self) -> None:
        """Start every worker and wait until each listens (WorkerFailed when one cannot)."""
        for index in range(self.config.workers):
            await self._spawn(index)
        for worker in self.workers:
            await self._until_listening(worker)

    async def _spawn(self, index: int) -> Worker:
        loop = asyncio.get_running_loop()
        ours, theirs = self._context.Pipe(duplex=True)  # a socket pair
        self.workers[index] = worker = Worker(index)
        Ledger(self._shared.ledger, worker.owner).reset()
        args = WorkerArgs(worker.index, self.config, self._shared, os.getpid(), theirs)
        process = self._context.Process(target=worker_main, args=(args,), name=f"llm-diag-proxy-worker-{worker.index}",
                                        daemon=True)
        process.start()
        theirs.close()  # the worker holds its own end; EOF here means it is gone
        worker.process = process
        sock = socket.socket(fileno=os.dup(ours.fileno()))
        ours.close()
        link = Link(lambda message: self._told(worker, message))
        worker.link = link
        await loop.connect_accepted_socket(lambda: link, sock)
        loop.add_reader(process.sentinel, self._exited, worker, process)
        return worker

    def _told(self, worker: Worker, message: Any) -> None:
        if isinstance(message, MetricsSnapshot):
            worker.snapshot = message  # (kept as bytes: read only when served or retired)
        elif isinstance(message, Listening):
            worker.url = message.url
            worker.listening.set()
            if worker.link is not None:
                worker.link.tell(self._recent_samples())
            self._process_metrics.workers.set(self.alive)  # (and when one exits: not per message, a wait4(2) each)

    async def _until_listening(self, worker: Worker) -> None:
        assert worker.link is not None
        waiter = asyncio.ensure_future(worker.listening.wait())
        ended = asyncio.ensure_future(worker.link.closed.wait())
        _, pending = await asyncio.wait({waiter, ended}, timeout=START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if not worker.listening.is_set():
            raise WorkerFailed(f"worker {worker.index} did not start listening on {self.config.listen} "
                               "(is the port taken by a process without SO_REUSEPORT?)")

    def _exited(self, worker: Worker, process: Any) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(process.sentinel)
        process.join(0)
        self._process_metrics.workers.set(self.alive)
        # What it held goes back at once, so that no later request sees its requests in flight.
        in_flight = self._tracker.forget(worker.owner)
        held = self._bytes.forget(worker.owner)
        self._gate.forget(worker.owner)  # its tokenizer calls in flight end with it
        ledger = Ledger(self._shared.ledger, worker.owner)  # (read now: a restart starts it anew)
        lost = ledger.lost(history=self.config.history_path is not None)
        self._spawn_task(self._account(worker, process, in_flight, held, lost, ledger[OPEN],
                                       ledger[DELIVERED]))
        if self.stopping:
            return
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < 60.0] + [now]
        if len(self._restarts) > RESTARTS_PER_MINUTE:
            _log.error("worker_keeps_dying", worker=worker.index, exit_code=process.exitcode,
                       note=f"more than {RESTARTS_PER_MINUTE} restarts in a minute: the proxy stops")
            self.failed.set()
            return
        self._spawn_task(self._restart(worker.index))

    def _spawn_task(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _account(self, worker: Worker, process: Any, in_flight: int, held: int, lost: int,
                       open_exchanges: int, delivered: int) -> None:
        """Once its link has given up what it held (its last snapshot): its counts kept in the sum,
        and the records it took with it counted and said once."""
        if worker.link is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(worker.link.closed.wait(), LINK_WAIT_S)
        exit_code = await _exit_code(process)
        last = worker.snapshot
        uncounted = max(0, delivered - (last.delivered if last is not None else 0))
        if last is not None:
            self.merged.update(worker.key, pickle.loads(last.families))
        self.merged.retire(worker.key)
        if lost:
            self.own.records_lost.inc(lost)
        if exit_code == 0 and not lost:
            return  # a worker that stopped as asked
        _log.error("worker_died", worker=worker.index, exit_code=exit_code, in_flight_released=in_flight,
                   parse_bytes_released=held, open_exchanges=max(0, open_exchanges), records_lost=lost,
                   records_uncounted=uncounted,
                   note="its requests leave the in-flight count and its bytes held for parsing are given back; "
                        "records_uncounted: records it delivered after its last metrics snapshot, missing from "
                        "the metrics (their log lines and history rows were written)"
                        + ("" if self.stopping else "; starting it again"))

    async def _restart(self, index: int) -> None:
        try:
            await self._until_listening(await self._spawn(index))
        except (OSError, WorkerFailed) as exc:
            _log.error("worker_restart_failed", worker=index, error=str(exc)[:300])
            self.failed.set()

    async def stop(self, grace_s: float) -> None:
        """SIGTERM to every worker; wait for each to drain (grace + the end wait), write its records
        and send its last snapshot; kill what is left."""
        self.stopping = True
        running = [w for w in self.workers if w.alive]
        for worker in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s + END_WAIT_S + 5.0
        while any(w.process.is_alive() for w in running) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for worker in running:
            if worker.process.is_alive():
                _log.error("worker_did_not_stop", worker=worker.index, note="killed")
                worker.process.kill()
        for worker in self.workers:  # their last messages are in the links until each reads EOF
            if worker.process is None:
                continue
            if worker.link is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(worker.link.closed.wait(), 5.0)
            worker.process.join(1.0)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


async def _exit_code(process: Any, wait_s: float = 2.0) -> int | None:
    """The exit code of a worker whose sentinel said it ended. The sentinel can say so a moment
    before the process can be reaped (a process closes its files before it is a zombie): without
    this wait a worker that stopped as asked read as one that died, with no exit code."""
    deadline = time.monotonic() + wait_s
    process.join(0)
    while process.exitcode is None and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
        process.join(0)
    code: int | None = process.exitcode
    return code


class WorkerRecords:
    """The admin listener's records with N workers: asked of each worker, merged (`RecordSource`)."""

    def __init__(self, supervisor: WorkerSupervisor, history: HistorySource | None) -> None:
        self._supervisor = supervisor
        self.history_source = history

    async def _ask_all(self, question: Any) -> list[Any]:
        asked = self._supervisor.links()
        found = await asyncio.gather(*(link.ask(question) for _, link in asked), return_exceptions=True)
        answers = []
        for (worker, _), answer in zip(asked, found, strict=True):
            if isinstance(answer, BaseException):
                if not isinstance(answer, LinkClosed):  # (one that is gone is being restarted)
                    _log.warning("worker_did_not_answer", worker=worker.index, question=type(question).__name__,
                                 error=repr(answer)[:200])
                continue
            answers.append(answer)
        return answers

    async def settle(self) -> bool | None:
        if self.history_source is None:
            return None
        answers = await self._ask_all(Settle())
        return bool(answers) and all(answer.history_up for answer in answers)

    async def page(self, query: RecordQuery) -> PageFound:
        """Each worker's page, merged newest first by sequence number (no two workers give one number)."""
        pages: list[PageFound] = await self._ask_all(PageAsked(query))
        records = sorted((entry for page in pages for entry in page.records), key=lambda entry: -entry[0])
        more = len(records) > query.limit or any(page.more for page in pages)
        return PageFound(records[:query.limit], more, sum(p.stored for p in pages), sum(p.capacity for p in pages))

    async def get(self, request_id: str) -> bytes | None:
        for answer in await self._ask_all(RecordAsked(request_id)):
            if answer.record is not None:
                return bytes(answer.record)
        return None

    async def ring(self, query: RecordQuery) -> list[bytes]:
        return [blob for answer in await self._ask_all(RingAsked(query)) for blob in answer.blobs]

    async def refresh_metrics(self) -> None:
        await self._supervisor.refresh_metrics()


def reserve_port(where: HostPort) -> tuple[socket.socket, HostPort]:
    """For port 0, a free port held by a bound (not listening) SO_REUSEPORT socket until every
    worker listens on it; any other port as it is (the socket only checks it can be shared)."""
    family = socket.AF_INET6 if ":" in where.host else socket.AF_INET
    held = socket.socket(family, socket.SOCK_STREAM)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        held.bind((where.host, where.port))
    except OSError:
        held.close()
        raise
    return held, replace(where, port=held.getsockname()[1])


def serve_workers(config: ProxyConfig) -> int:
    """Run the supervisor and its workers until SIGINT/SIGTERM; returns the exit code."""
    try:
        return run_loop(_supervise(config))
    except KeyboardInterrupt:
        return 0


async def _supervise(config: ProxyConfig) -> int:
    if not hasattr(socket, "SO_REUSEPORT"):
        print("llm-diag-proxy: error: --workers needs SO_REUSEPORT, which this platform lacks", file=sys.stderr)
        return 2
    files = open_files()  # (before the workers start: they inherit it)
    if config.otel:  # each worker exports its own spans: said here, once, before any starts
        try:
            Tracer(config.upstream).close()
        except TracingUnavailable as exc:
            print(f"llm-diag-proxy: error: --otel: {exc}", file=sys.stderr)
            return 2
    try:
        held, where = reserve_port(config.listen)
    except OSError as exc:
        print(f"llm-diag-proxy: error: cannot listen: {exc.strerror or exc}", file=sys.stderr)
        return 2
    # One secret for every worker (a key gets one name whichever worker took the request).
    config = replace(config, listen=where, client_secret=config.client_secret or secrets.token_bytes(32))
    shared = SharedState.allocate(multiprocessing.get_context("spawn"))
    process_metrics = ProcessMetrics(max_models=config.max_models)
    merged = MergedMetrics()
    process_metrics.registry.register(merged)
    own = RecordMetrics(max_models=config.max_models, max_clients=config.client_metrics)
    in_flight = InFlightTracker(counts=shared.counts)
    parse_bytes = ParseBytes(config.parse_bytes_max, shared=shared.parse_bytes)
    process_metrics.read_state(in_flight=lambda: in_flight.in_flight, parse_bytes_used=lambda: parse_bytes.used,
                               parse_bytes_refusals=lambda: parse_bytes.refused)
    if config.history_path is None:
        own.history_up.set(0)
    telemetry = Telemetry(config, process_metrics)
    supervisor = WorkerSupervisor(config, shared, merged, own, process_metrics)
    supervisor.follow(telemetry)
    session = upstream_session(config)
    identity_session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10),
                                             headers={"Authorization": config.upstream_authorization}
                                             if config.upstream_authorization else None)
    identity = IdentityPoller(identity_session, config.upstream, enabled=config.upstream_metrics != "off")
    history = None if config.history_path is None else HistorySource(config.history_path, config.history_password)
    urls = {"proxy": "", "admin": ""}
    admin_app = build_admin_app(
        WorkerRecords(supervisor, history), process_metrics.registry,
        UpstreamReachability(config.upstream, session, config.upstream_authorization), config.admin_token,
        ready=lambda: supervisor.ready, allowed_hosts=config.admin_allowed_hosts, readers=AdminReaders(),
        instance=config.instance,
        about=about(config, lambda: urls["proxy"], lambda: urls["admin"],
                    lambda: identity.identity if identity.enabled else UNKNOWN_SERVER),
        traces=TraceReceiver(lambda spans: supervisor.tell_all(ServerSpans(tuple(spans))), own.count_spans).handle
        if config.server_traces else None)
    admin_runner = None
    identifying: asyncio.Task[None] | None = None
    code = 0
    try:
        admin_runner, _, urls["admin"] = await listen(
            admin_app, config.admin_listen, backlog=config.backlog, header_timeout_s=config.header_timeout_s,
            on_refused=own.count_refused, shutdown_timeout=RUNNER_SHUTDOWN_S)
        await telemetry.start()
        if identity.enabled:
            identifying = asyncio.get_running_loop().create_task(identity.run(), name="server-identity")
        await supervisor.start()
        held.close()
        process_metrics.workers.set(supervisor.alive)
        urls["proxy"] = supervisor.workers[0].url or ""
        _log.info("listening", proxy=urls["proxy"], admin=urls["admin"], upstream=config.upstream,
                  workers=config.workers, deadline_s=config.deadline_s, idle_timeout_s=config.idle_timeout_s,
                  deadline_mode=config.deadline_mode, shutdown_grace_s=config.shutdown_grace_s,
                  instance=config.instance, history=history_shown(config), open_files=files)
        await until_stopped(supervisor.failed.wait())
        code = 1 if supervisor.failed.is_set() else 0
    except OSError as exc:
        print(f"llm-diag-proxy: error: cannot listen: {exc.strerror or exc}", file=sys.stderr)
        code = 2
    except WorkerFailed as exc:
        print(f"llm-diag-proxy: error: {exc}", file=sys.stderr)
        code = 2
    finally:
        started = time.monotonic()
        _log.info("stopping", shutdown_grace_s=config.shutdown_grace_s, workers=config.workers)
        await supervisor.stop(config.shutdown_grace_s)
        held.close()
        if identifying is not None:
            identifying.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await identifying
        if admin_runner is not None:
            await admin_runner.cleanup()
        await telemetry.stop()
        await session.close()
        await identity_session.close()
        shared.remove()
        _log.info("stopped", seconds=round(time.monotonic() - started, 3))
    return code
