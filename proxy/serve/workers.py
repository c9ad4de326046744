"""`--workers N`: N processes serve the proxy port; one supervisor holds everything proxy-wide.

Each worker is a whole forwarding path (its own event loop, listener and upstream pool) on the
same port: every worker binds it with SO_REUSEPORT and the kernel spreads new connections over
them. What must stay proxy-wide is not split:

- the in-flight count and every concurrency figure come from one set of counts in shared
  memory, updated under one lock (`proxy.relay.in_flight.SharedCounts`); so is the parse budget;
- each finished record goes, length-prefixed JSON over a pipe, to the supervisor, which runs the
  observers a single process runs (telemetry's enricher, metrics, the log line, the record
  store): `/metrics` and `/api/requests` see every worker's exchanges, and the admin listener,
  NVML and the upstream's own metrics are polled once;
- deadlines, disconnects and the shutdown grace act inside each worker as with one process. On
  SIGTERM the supervisor passes it on, waits for every worker to drain and hand over its last
  records, then stops.

A worker that dies is started again (at most RESTARTS_PER_MINUTE a minute; past that the proxy
stops with exit code 1 rather than serve at a fraction of itself). A worker never blocks on the
supervisor: when its pipe holds more than SEND_BUFFER_MAX bytes, records are dropped and counted
(`llm_proxy_records_lost_total`).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import secrets
import signal
import socket
import struct
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

import orjson
import structlog

from proxy.config import HostPort, ProxyConfig
from proxy.diagnosis.delivery import Delivery, LostRecords
from proxy.diagnosis.tokenizer_queue import CallGate, shared_gate
from proxy.observers.hooks import Observer
from proxy.observers.logs import configure_logging
from proxy.observers.metrics import ProxyMetrics
from proxy.observers.tracing import TracingUnavailable
from proxy.processes import OWNERS, follow_parent
from proxy.record import ResponseRecord, record_from_dict
from proxy.relay.in_flight import InFlightTracker, SharedCounts
from proxy.relay.listeners import listen
from proxy.serve import wiring
from proxy.wire.byte_budget import ByteBudget, shared_budget

_log = structlog.get_logger("llm_diag_proxy")
FRAME = struct.Struct(">I")
MAX_MESSAGE = 16 * 1024 * 1024  # one record is a few KB; anything near this is a broken channel
SEND_BUFFER_MAX = 8 * 1024 * 1024
START_TIMEOUT_S = 60.0
RESTARTS_PER_MINUTE = 5
CHANNEL_WAIT_S = 5.0  # how long a dead worker's pipe may take to give up its last records


# --- the worker side -------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerArgs:
    """What a worker process is started with (pickled to it)."""

    index: int
    config: ProxyConfig
    counts: SharedCounts
    budget: tuple[Any, Any, Any]
    ledger: Any  # RawArray("q"): per worker, its exchanges without a record yet and its records written
    supervisor: int  # the supervisor's pid: a worker does not outlive it
    channel: Connection  # the write end of its pipe to the supervisor
    gate: tuple[Any, Any, Any]  # the tokenizer calls' shared gate (proxy.diagnosis.tokenizer_queue)

    @property
    def owner(self) -> int:
        """Its slot in the shared counts (0 is a single process's)."""
        return self.index + 1


class RecordSender(Observer):
    """The worker's one observer: each finished record, and each refused request, to the supervisor.

    The messages of one turn of the loop go in one write: records of answers that ended together
    cost the supervisor one wake-up and one read, not one each.

    It keeps its ledger in shared memory, written by this worker alone: the exchanges begun whose
    record is not written yet, and the records written to the pipe. When the worker dies, the
    supervisor counts every record the ledger shows it will never read."""

    def __init__(self, transport: asyncio.WriteTransport, ledger: Any = None, owner: int = 0) -> None:
        self._transport = transport
        self.lost = 0  # not yet reported
        self._ledger = ledger if ledger is not None else [0] * (2 * (owner + 1))
        self._pending, self._written = 2 * owner, 2 * owner + 1
        self._frames: list[bytes] = []  # this turn's messages, written at its end
        self._queued = 0  # their bytes
        self._failures = LostRecords()  # (said once per kind; the count goes to the supervisor as `lost`)

    def lost_one(self) -> None:
        """A record the diagnosis could not make (counted by the supervisor with the next message)."""
        self.lost += 1

    def send(self, message: dict[str, Any]) -> None:
        transport = self._transport
        if transport.is_closing() or transport.get_write_buffer_size() + self._queued > SEND_BUFFER_MAX:
            self.lost += "record" in message
            return
        try:
            payload = orjson.dumps(message, default=str)
        except (TypeError, ValueError) as exc:  # a record the diagnosis failed to make writable: lost, counted
            self.lost += "record" in message
            self._failures.failed(exc, "record_not_sent")
            return
        if self.lost:
            lost, self.lost = self.lost, 0
            self.send({"lost": lost})
        if not self._frames:
            asyncio.get_running_loop().call_soon(self._write)
        self._frames.append(FRAME.pack(len(payload)) + payload)
        self._queued += FRAME.size + len(payload)
        if "record" in message:
            self._ledger[self._written] += 1

    def _write(self) -> None:
        frames, self._frames, self._queued = self._frames, [], 0
        if frames and not self._transport.is_closing():  # (closing: counted written, never read: lost)
            self._transport.write(b"".join(frames))

    def on_response_start(self, record: ResponseRecord) -> None:
        self._ledger[self._pending] += 1

    def on_response(self, record: ResponseRecord) -> None:
        self._ledger[self._pending] -= 1
        fields = record.to_compact_dict()  # (its None fields are the defaults `record_from_dict` puts back)
        del fields["cause"], fields["outcome"]  # derived: the supervisor's record derives them again
        self.send({"record": fields})

    def refused(self, reason: str) -> None:
        self.send({"refused": reason})

    async def flush(self, timeout_s: float) -> None:
        """Wait until what was written reached the pipe (bounded), then close it."""
        self._write()
        deadline = time.monotonic() + timeout_s
        while self._transport.get_write_buffer_size() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._transport.close()



def worker_main(args: WorkerArgs) -> None:
    """The entry point of a worker process."""
    follow_parent(args.supervisor)  # no worker keeps the port open with no one reading its records
    config = args.config
    configure_logging(config.log_level, config.log_format)
    structlog.contextvars.bind_contextvars(worker=args.index)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the supervisor, which says when
    wiring.run_loop(_worker(args))


async def _worker(args: WorkerArgs) -> None:
    config = args.config
    loop = asyncio.get_running_loop()
    pipe = os.fdopen(os.dup(args.channel.fileno()), "wb", buffering=0)
    args.channel.close()
    transport, _ = await loop.connect_write_pipe(asyncio.Protocol, pipe)
    sender = RecordSender(transport, args.ledger, args.owner)
    tracker = InFlightTracker(counts=args.counts, owner=args.owner)
    budget = ByteBudget(config.parse_budget_bytes, shared=args.budget, owner=args.owner)
    # A worker's records go to the supervisor as they end, not in batches as one process delivers
    # them: nothing here could deliver what waits when the supervisor's admin listener is read, and
    # an answer that has ended must not be missing there for a tenth of a second. They go through a
    # Delivery as in one process, the tokenizer's too (each record made writable, each failure kept
    # from the client's connection and the other records).
    delivery = Delivery([sender], on_lost=sender.lost_one)
    check = wiring.server_check(config, delivery.response_finished, lambda result: sender.send({"tokenizer": result}),
                                on_lost=sender.lost_one, gate=CallGate(shared=args.gate, owner=args.owner))
    forwarder = wiring.proxy_application(config, delivery, tracker, budget, check, sender.refused)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    runner, site, url = await listen(forwarder.handle, config.listen, backlog=config.backlog,
                                     header_timeout_s=config.header_timeout_s, on_refused=sender.refused,
                                     shutdown_timeout=wiring.RUNNER_SHUTDOWN_S, handler_cancellation=True,
                                     reuse_port=True)
    check.start()
    sender.send({"listening": url, "pid": os.getpid()})
    await stop.wait()
    started = time.monotonic()
    await site.stop()
    await wiring.drain(forwarder, started + config.shutdown_grace_s, config.shutdown_grace_s)
    forwarder.end_active()
    await runner.cleanup()
    await check.close()
    await forwarder.close()
    await sender.flush(wiring.END_WAIT_S)


# --- the supervisor --------------------------------------------------------------------------
class WorkerFailed(Exception):
    """A worker could not start, or kept dying."""


class FrameReader(asyncio.Protocol):
    """Length-prefixed JSON messages from one worker's pipe."""

    def __init__(self, on_message: Any, on_end: Any) -> None:
        self._buffer = bytearray()
        self._on_message = on_message
        self._on_end = on_end

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while len(buffer) >= FRAME.size:
            (size,) = FRAME.unpack_from(buffer)
            if size > MAX_MESSAGE:
                _log.error("worker_channel_broken", detail=f"a message of {size} bytes")
                buffer.clear()
                return
            if len(buffer) < FRAME.size + size:
                return
            payload = bytes(buffer[FRAME.size:FRAME.size + size])
            del buffer[:FRAME.size + size]
            try:
                self._on_message(orjson.loads(payload))
            except Exception as exc:  # a bad message must not end the supervisor
                _log.warning("worker_message_unreadable", error=repr(exc)[:300])

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_end()


class Channel:
    """One worker process's pipe, as the supervisor reads it: its end, and the records it gave."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.records = 0


class Worker:
    """One worker process as the supervisor sees it (a restart is a new process in the same slot)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: Any = None
        self.url: str | None = None
        self.listening = asyncio.Event()
        self.channel = Channel()

    @property
    def channel_closed(self) -> asyncio.Event:
        return self.channel.closed

    @property
    def owner(self) -> int:
        return self.index + 1


class WorkerPool:
    """Starts, watches, restarts and stops the workers; hands their messages to the exporters; gives
    back what a worker that died held (its in-flight requests, its parse budget) and counts the
    records it took with it."""

    def __init__(self, config: ProxyConfig, counts: SharedCounts, budget: tuple[Any, Any, Any], chain: Delivery,
                 metrics: ProxyMetrics, gate: tuple[Any, Any, Any] | None = None) -> None:
        self._context = multiprocessing.get_context("spawn")
        self._config = config
        self._counts = counts
        self._budget = budget
        self._gate_state = gate if gate is not None else shared_gate(self._context)
        self._gate = CallGate(shared=self._gate_state)
        self._tracker = InFlightTracker(counts=counts)
        self._bytes = ByteBudget(config.parse_budget_bytes, shared=budget)
        self._ledger: Any = self._context.RawArray("q", 2 * OWNERS)
        self._chain = chain
        self._metrics = metrics
        self.workers = [Worker(i) for i in range(config.workers)]
        self.stopping = False
        self.failed = asyncio.Event()
        self._restarts: list[float] = []
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def alive(self) -> int:
        return sum(1 for w in self.workers if w.process is not None and w.process.is_alive())

    @property
    def ready(self) -> bool:
        """The proxy port accepts: some worker is alive and listening on it, and none is stopping."""
        return not self.stopping and any(w.listening.is_set() and w.process is not None and w.process.is_alive()
                                         for w in self.workers)

    async def start(self) -> None:
        """Start every worker and wait until each listens (WorkerFailed when one cannot)."""
        for worker in self.workers:
            await self._spawn(worker)
        for worker in self.workers:
            await self._until_listening(worker)

    async def _spawn(self, worker: Worker) -> None:
        loop = asyncio.get_running_loop()
        reader, writer = self._context.Pipe(duplex=False)
        worker.listening = asyncio.Event()
        worker.channel = channel = Channel()
        self._ledger[2 * worker.owner] = self._ledger[2 * worker.owner + 1] = 0
        args = WorkerArgs(worker.index, self._config, self._counts, self._budget, self._ledger, os.getpid(), writer,
                          self._gate_state)
        process = self._context.Process(target=worker_main, args=(args,), name=f"llm-diag-proxy-worker-{worker.index}",
                                        daemon=True)
        process.start()
        writer.close()  # the worker holds its own end; EOF here means it is gone
        worker.process = process
        pipe = os.fdopen(os.dup(reader.fileno()), "rb", buffering=0)
        reader.close()
        await loop.connect_read_pipe(
            lambda: FrameReader(lambda message: self._message(worker, channel, message), channel.closed.set), pipe)
        loop.add_reader(process.sentinel, self._exited, worker, process)

    async def _until_listening(self, worker: Worker) -> None:
        waiter = asyncio.ensure_future(worker.listening.wait())
        ended = asyncio.ensure_future(worker.channel_closed.wait())
        _, pending = await asyncio.wait({waiter, ended}, timeout=START_TIMEOUT_S,
                                           return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if not worker.listening.is_set():
            raise WorkerFailed(f"worker {worker.index} did not start listening on {self._config.listen} "
                               "(is the port taken by a process without SO_REUSEPORT?)")

    def _message(self, worker: Worker, channel: Channel, message: dict[str, Any]) -> None:
        record = message.get("record")
        if isinstance(record, dict):
            channel.records += 1
            self._chain.response_finished(record_from_dict(record))
        elif "refused" in message:
            self._metrics.count_refused(str(message["refused"]))
        elif "lost" in message:
            self._metrics.records_lost.inc(int(message["lost"]))
        elif "tokenizer" in message:
            self._metrics.count_tokenizer(str(message["tokenizer"])[:16])
        elif "listening" in message:
            worker.url = str(message["listening"])
            worker.listening.set()
            self._metrics.workers.set(self.alive)  # (and when one exits: not per message, a wait4(2) each)

    def _exited(self, worker: Worker, process: Any) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(process.sentinel)
        process.join(0)
        self._metrics.workers.set(self.alive)
        if worker.process is not process:
            return
        # What it held goes back at once, so that no later request sees its requests in flight.
        in_flight = self._tracker.forget(worker.owner)
        held = self._bytes.forget(worker.owner)
        self._gate.forget(worker.owner)  # its tokenizer calls in flight end with it
        pending, written = self._ledger[2 * worker.owner], self._ledger[2 * worker.owner + 1]
        self._spawn_task(self._account(worker, worker.channel, process.exitcode, in_flight, held, pending, written))
        if self.stopping:
            return
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < 60.0] + [now]
        if len(self._restarts) > RESTARTS_PER_MINUTE:
            _log.error("worker_keeps_dying", worker=worker.index, exit_code=process.exitcode,
                       note=f"more than {RESTARTS_PER_MINUTE} restarts in a minute: the proxy stops")
            self.failed.set()
            return
        self._spawn_task(self._restart(worker))

    def _spawn_task(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _account(self, worker: Worker, channel: Channel, exit_code: int | None, in_flight: int, held: int,
                       pending: int, written: int) -> None:
        """Once its pipe has given up what it held: the records a dead worker took with it (exchanges
        begun with no record written, and records written that never arrived), counted and said once."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(channel.closed.wait(), CHANNEL_WAIT_S)
        lost = max(0, pending) + max(0, written - channel.records)
        if lost:
            self._metrics.records_lost.inc(lost)
        if exit_code == 0 and not lost:
            return  # a worker that stopped as asked
        _log.error("worker_died", worker=worker.index, exit_code=exit_code, in_flight_released=in_flight,
                   parse_budget_released_bytes=held, open_exchanges=max(0, pending), records_lost=lost,
                   note="its requests leave the in-flight count and its budget is given back"
                        + ("" if self.stopping else "; starting it again"))

    async def _restart(self, worker: Worker) -> None:
        try:
            await self._spawn(worker)
            await self._until_listening(worker)
        except (OSError, WorkerFailed) as exc:
            _log.error("worker_restart_failed", worker=worker.index, error=str(exc)[:300])
            self.failed.set()

    async def stop(self, grace_s: float) -> None:
        """SIGTERM to every worker; wait for each to drain (grace + the end wait) and hand over its
        last records; kill what is left."""
        self.stopping = True
        running = [w for w in self.workers if w.process is not None and w.process.is_alive()]
        for worker in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s + wiring.END_WAIT_S + 5.0
        while any(w.process.is_alive() for w in running) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for worker in running:
            if worker.process.is_alive():
                _log.error("worker_did_not_stop", worker=worker.index, note="killed")
                worker.process.kill()
        for worker in self.workers:  # their last records are in the pipes until each reads EOF
            if worker.process is None:
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(worker.channel_closed.wait(), 5.0)
            worker.process.join(1.0)


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
        return wiring.run_loop(_supervise(config))
    except KeyboardInterrupt:
        return 0


async def _supervise(config: ProxyConfig) -> int:
    if not hasattr(socket, "SO_REUSEPORT"):
        print("llm-diag-proxy: error: --workers needs SO_REUSEPORT, which this platform lacks", file=sys.stderr)
        return 2
    try:
        held, where = reserve_port(config.listen)
    except OSError as exc:
        print(f"llm-diag-proxy: error: cannot listen: {exc.strerror or exc}", file=sys.stderr)
        return 2
    # One secret for every worker (a key gets one name whichever worker took the request).
    config = replace(config, listen=where, client_secret=config.client_secret or secrets.token_bytes(32))
    context = multiprocessing.get_context("spawn")
    counts = SharedCounts(context)
    budget_state = shared_budget(context)
    try:
        observing = wiring.Observing.open(config)
    except TracingUnavailable as exc:
        held.close()
        print(f"llm-diag-proxy: error: --otel: {exc}", file=sys.stderr)
        return 2
    metrics = observing.metrics
    view = InFlightTracker(counts=counts)
    budget = ByteBudget(config.parse_budget_bytes, shared=budget_state)
    metrics.read_state(in_flight=lambda: view.in_flight, parse_budget_used=lambda: budget.used,
                       parse_budget_refusals=lambda: budget.refused)
    pool = WorkerPool(config, counts, budget_state, observing.delivery, metrics)
    session = wiring.upstream_session(config)
    admin_app = observing.admin(config, session, ready=lambda: pool.ready)
    admin_runner = None
    code = 0
    try:
        admin_runner, _, admin_url = await listen(
            admin_app, config.admin_listen, backlog=config.backlog, header_timeout_s=config.header_timeout_s,
            on_refused=metrics.count_refused, shutdown_timeout=wiring.RUNNER_SHUTDOWN_S)
        await observing.telemetry.start()
        await pool.start()
        held.close()
        metrics.workers.set(pool.alive)
        _log.info("listening", proxy=pool.workers[0].url, admin=admin_url, upstream=config.upstream,
                  workers=config.workers, deadline_s=config.deadline_s, idle_timeout_s=config.idle_timeout_s,
                  deadline_mode=config.deadline_mode, shutdown_grace_s=config.shutdown_grace_s,
                  instance=config.instance, history=wiring.history_shown(config))
        await wiring.until_stopped(pool.failed.wait())
        code = 1 if pool.failed.is_set() else 0
    except OSError as exc:
        print(f"llm-diag-proxy: error: cannot listen: {exc.strerror or exc}", file=sys.stderr)
        code = 2
    except WorkerFailed as exc:
        print(f"llm-diag-proxy: error: {exc}", file=sys.stderr)
        code = 2
    finally:
        started = time.monotonic()
        _log.info("stopping", shutdown_grace_s=config.shutdown_grace_s, workers=config.workers)
        await pool.stop(config.shutdown_grace_s)
        held.close()
        if admin_runner is not None:
            await admin_runner.cleanup()
        await session.close()
        await observing.close()
        _log.info("stopped", seconds=round(time.monotonic() - started, 3))
    return code
