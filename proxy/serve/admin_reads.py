"""Admin reads that take more than a moment run in a process of their own, never on the relay's loop.

Why a process and not a thread: `/api/diagnose` over 50,000 records builds millions of objects.
In a thread of the relaying process it holds the GIL in 5 ms slices and, worse, sets off full
garbage collections that walk the whole heap while every stream waits (a live stream stalled by
0.35 s). Here a spawned process, niced, started at the first read and gone after IDLE_S without
one, reads the history itself and answers with the JSON body; the loop only moves bytes. Bodies
cross the pipe as raw bytes (`send_bytes`, which lets go of the GIL while it writes), never
pickled whole.

Bounded, each lane on its own so that a page never waits behind a verdict: pages of the
history, verdicts (`/api/diagnose`), and work on the in-memory ring (a page found in a thread
over a copy, records serialised a batch at a time) have a Gate each: one piece of work at a time,
WAITING more in line, past them 503 `admin_busy` with a Retry-After. Answers being written to
clients hold at most ANSWER_BYTES between them (a slow reader cannot pile pages up in memory).
A read that runs past TIMEOUT_S has its process killed and answers 503 `admin_read_timeout`.
The processes die with their parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

import orjson
import structlog

from proxy.observers.history import HistoryError, HistorySource
from proxy.observers.record_store import RecordQuery
from proxy.record import ResponseRecord, record_from_dict

_log = structlog.get_logger("llm_diag_proxy")
Blobs = Callable[[], Awaitable[list[bytes]]]  # made once a job's turn comes
WAITING = 8  # pieces of admin work that may wait for the one running, per lane; past them, 503
TIMEOUT_S = 120.0
IDLE_S = 60.0
NICE = 10  # the readers yield the cores to the relay
RING_BATCH = 200  # ring records serialised between two turns of the loop
ANSWER_BYTES = 64 << 20  # admin answers being written at once, all clients together


class AdminBusy(Exception):
    """Too much admin work at once: answered 503 with Retry-After."""


class AdminReadFailed(Exception):
    """The reader could not answer: it timed out, died, or the history could not be read (`kind`)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


# --- in the reader process ---------------------------------------------------------------------
def history_page(source: HistorySource, query: RecordQuery) -> bytes:
    """One page of /api/requests from the history, as the whole JSON body."""
    page = source.backend().page(query)
    return orjson.dumps({"count": len(page.records), "source": "history", "history": source.shown,
                         "records": [r.to_dict() for r in page.records], "next_cursor": page.next_cursor,
                         **({"skipped": page.skipped} if page.skipped else {})}, default=str)


def diagnose(source: HistorySource | None, query: RecordQuery, min_per_level: int, target: str, admin: str,
             by: str | None = None, blobs: Sequence[bytes] = ()) -> bytes:
    """The body of /api/diagnose: the records of the history that match `query` (or the ring's,
    sent as JSON arrays in `blobs`), grouped (`by` instance, upstream or model too) and judged as
    `llm-diag-proxy diagnose` does; the sweeps it suggests go through `target`, joined by `admin`."""
    from proxy.sweep.live import compare, count_lines, groups_of, verdict_json
    from proxy.sweep.timeouts import repeated_cuts
    from proxy.sweep.whose import lines as whose_lines

    records: list[ResponseRecord]
    skipped = 0
    if source is not None:
        backend = source.backend()
        records = list(backend.iterate(query, 50_000))
        skipped = backend.skipped[0]
    else:
        records = [record_from_dict(item) for blob in blobs for item in orjson.loads(blob)]
    groups = groups_of(records, min_per_level=min_per_level, by=by)
    found = verdict_json(groups, since=query.since or 0.0, records=len(records), min_per_level=min_per_level,
                         source="history" if source is not None else "memory", target=target, admin=admin)
    if skipped:  # rows no record can be read from (another version's, or damaged): left out, said
        found["skipped"] = skipped
    found["timeouts"] = [cut.to_dict() for cut in repeated_cuts(records)]
    found["whose"] = whose_lines(records) + count_lines(records)
    if query.instance is not None:
        found["instance"] = query.instance
    if by is not None:
        found["comparison"] = compare(groups, by, records)[0]
    return orjson.dumps(found, default=str)


JOBS: dict[str, Callable[..., bytes]] = {"history_page": history_page, "diagnose": diagnose}


def _call(jobs: dict[str, Callable[..., bytes]], name: str, args: tuple[Any, ...], blobs: list[bytes]) -> bytes:
    return jobs[name](*args, blobs=blobs) if blobs else jobs[name](*args)


def serve(connection: Connection, parent: int, jobs: dict[str, Callable[..., bytes]]) -> None:
    """The reader's loop until the parent closes the pipe or dies: `(name, args, blob count)` and
    the blobs in, `(status, detail)` out and, when the status is ok, the body."""
    from proxy.processes import follow_parent

    follow_parent(parent)
    with contextlib.suppress(OSError):
        os.nice(NICE)
    while True:
        try:
            name, args, count = connection.recv()
            blobs = [connection.recv_bytes() for _ in range(count)]
        except (EOFError, OSError):
            return
        body = b""
        try:
            body = _call(jobs, name, args, blobs)
            status: tuple[str, str | None] = ("ok", None)
        except HistoryError as exc:
            status = ("history", str(exc)[:300])
        except Exception as exc:  # a bug in a read must answer, not leave the proxy waiting
            status = ("error", f"{type(exc).__name__}: {str(exc)[:300]}")
        del blobs
        try:
            connection.send(status)
            if status[0] == "ok":
                connection.send_bytes(body)
        except OSError:
            return


# --- in the proxy ----------------------------------------------------------------------------------
class Gate:
    """One piece of admin work at a time, `waiting` more in line; past them AdminBusy."""

    def __init__(self, waiting: int = WAITING) -> None:
        self.waiting = waiting
        self._lock = asyncio.Lock()
        self.queued = 0  # running and waiting

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        if self.queued > self.waiting:
            raise AdminBusy(f"{self.queued} admin reads are running or waiting; try again shortly")
        self.queued += 1
        try:
            async with self._lock:
                yield
        finally:
            self.queued -= 1

    @property
    def idle(self) -> bool:
        return self.queued == 0


class AdminReader:
    """The proxy's side of one reader process: started when needed, one job at a time."""

    def __init__(self, *, waiting: int = WAITING, timeout_s: float = TIMEOUT_S, idle_s: float = IDLE_S,
                 jobs: dict[str, Callable[..., bytes]] | None = None) -> None:
        self.jobs_known = jobs or JOBS  # module-level functions: they reach the process by name
        self.gate = Gate(waiting)
        self.timeout_s = timeout_s
        self.idle_s = idle_s
        self._process: multiprocessing.process.BaseProcess | None = None
        self._connection: Connection | None = None
        self._idle: asyncio.TimerHandle | None = None
        self.answered = 0

    @property
    def waiting(self) -> int:
        return self.gate.waiting

    @waiting.setter
    def waiting(self, value: int) -> None:
        self.gate.waiting = value

    async def run(self, name: str, *args: Any, blobs: Blobs | None = None) -> bytes:
        """The job's answer. `blobs`, made once the job's turn comes (so that jobs in line hold
        nothing), are sent as raw bytes. A job that began goes on if the caller gives up (a closed
        admin request), so that the pipe never carries an answer nobody reads into the next job;
        one still in line is dropped."""
        begun = asyncio.Event()
        task = asyncio.ensure_future(self._run(name, args, blobs, begun))
        task.add_done_callback(_retrieved)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not begun.is_set():
                task.cancel()
            raise

    async def _run(self, name: str, args: tuple[Any, ...], make_blobs: Blobs | None, begun: asyncio.Event) -> bytes:
        async with self.gate.turn():
            begun.set()
            blobs = await make_blobs() if make_blobs is not None else []
            if self._idle is not None:
                self._idle.cancel()
                self._idle = None
            try:
                connection = await asyncio.to_thread(self._start)  # a fork and exec: ms of the loop's time
            except Exception as exc:  # e.g. a daemonic process may have no children: read here, in a thread
                _log.warning("admin_reader_unavailable", error=f"{type(exc).__name__}: {str(exc)[:200]}",
                             detail="the admin read runs in a thread of the proxy instead")
                return await asyncio.to_thread(self._inline, name, args, blobs)
            try:
                status, detail, body = await asyncio.to_thread(self._exchange, connection, name, args, blobs)
            except TimeoutError:
                await self._stop(kill=True)
                raise AdminReadFailed("admin_read_timeout", f"the read took more than {self.timeout_s:g} s; "
                                      "ask for less (since, limit)") from None
            except (EOFError, OSError):
                await self._stop(kill=True)
                raise AdminReadFailed("admin_read_failed", "the admin reader process died; it restarts with "
                                      "the next read") from None
            finally:
                self._idle = asyncio.get_running_loop().call_later(
                    self.idle_s, lambda: asyncio.ensure_future(self._stop_if_idle()))
            self.answered += 1
            if status == "error":  # a bug: its words are for the log, not for whoever asked
                _log.error("admin_read_failed", job=name, error=detail)
                raise AdminReadFailed("admin_read_failed", "the admin read failed; the proxy's log says why")
            if status != "ok":
                raise AdminReadFailed(status, detail or "")
            return body

    def _inline(self, name: str, args: tuple[Any, ...], blobs: list[bytes]) -> bytes:
        try:
            return _call(self.jobs_known, name, args, blobs)
        except HistoryError as exc:
            raise AdminReadFailed("history", str(exc)[:300]) from None

    def _exchange(self, connection: Connection, name: str, args: tuple[Any, ...],
                  blobs: list[bytes]) -> tuple[str, str | None, bytes]:
        connection.send((name, args, len(blobs)))
        for blob in blobs:
            connection.send_bytes(blob)
        if not connection.poll(self.timeout_s):
            raise TimeoutError
        status, detail = connection.recv()
        return status, detail, connection.recv_bytes() if status == "ok" else b""

    @property
    def pid(self) -> int | None:
        """The reader process's, while it runs."""
        return self._process.pid if self._process is not None and self._process.is_alive() else None

    def _start(self) -> Connection:
        if self._process is not None and self._process.is_alive() and self._connection is not None:
            return self._connection
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads and a loop
        ours, theirs = context.Pipe()
        process = context.Process(target=serve, args=(theirs, os.getpid(), self.jobs_known),
                                  name="llm-diag-proxy-admin-reader", daemon=True)
        process.start()
        theirs.close()
        self._process, self._connection = process, ours
        return ours

    async def _stop_if_idle(self) -> None:
        if self.gate.idle:
            await self._stop(kill=False)

    async def _stop(self, *, kill: bool) -> None:
        process, connection = self._process, self._connection
        self._process = self._connection = None
        if connection is not None:
            connection.close()  # the reader sees EOF and returns
        if process is not None:
            if kill:
                process.kill()
            await asyncio.to_thread(process.join, 5.0)
            if process.is_alive():
                process.kill()
                await asyncio.to_thread(process.join, 5.0)

    async def close(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        await self._stop(kill=False)


def _retrieved(task: asyncio.Future[bytes]) -> None:
    if not task.cancelled():
        task.exception()  # a caller that gave up has nobody else to hear it


class AdminReaders:
    """The admin listener's lanes: history pages and verdicts a process each, the ring a gate."""

    def __init__(self, *, answer_bytes: int = ANSWER_BYTES, **options: Any) -> None:
        self.pages = AdminReader(**options)
        self.verdicts = AdminReader(**options)
        self.memory = Gate(options.get("waiting", WAITING))
        self.answer_bytes = answer_bytes
        self.answering = 0  # bytes of answers being written now

    async def run(self, name: str, *args: Any, blobs: Blobs | None = None) -> bytes:
        return await (self.verdicts if name == "diagnose" else self.pages).run(name, *args, blobs=blobs)

    @contextlib.contextmanager
    def answering_with(self, size: int) -> Iterator[None]:
        """Hold `size` bytes of the answers' bound while one is written; AdminBusy past it."""
        if self.answering and self.answering + size > self.answer_bytes:
            raise AdminBusy(f"{self.answering >> 20} MiB of admin answers are still being written; "
                            "try again shortly")
        self.answering += size
        try:
            yield
        finally:
            self.answering -= size

    async def close(self) -> None:
        await asyncio.gather(self.pages.close(), self.verdicts.close())
