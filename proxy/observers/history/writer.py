"""The history's writer: an observer like the others, with a thread of its own.

`on_response` puts the record in a bounded buffer and returns; the writer thread takes them in
batches (one transaction each, at most FLUSH_S after the first), so the event loop never waits on
a disk or a database. Retention runs on that thread too.

When the database fails, the traffic is untouched and the proxy says so once: one log line,
`llm_proxy_history_up 0`, and a count of the records not kept (`llm_proxy_history_dropped`).
- A database that cannot be reached (PostgreSQL down, restarting, refusing the login, slow): the
  writer holds its batch and reconnects with backoff (BACKOFF_MIN_S doubling to BACKOFF_MAX_S);
  records wait in the buffer (`buffer` records, plus the batch in hand) and past it are counted
  as dropped. When it answers again, one line says so and the buffer is written.
- A batch the database refuses (a full disk, a file that cannot be written): that batch is
  counted as dropped and the writer goes on with the next.

Read-your-writes: `settle()` waits until every record handed to the writer before it was written
(or counted as dropped), cutting the batch's wait short, so that a page listed right after a
response holds its record.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import structlog

from proxy.observers.history.backend import Backend, HistoryError, Rejected, Unavailable
from proxy.observers.history.source import HistorySource
from proxy.observers.hooks import Observer
from proxy.observers.record_store import Page, RecordQuery
from proxy.record import CompactOnce, ResponseRecord

_log = structlog.get_logger("llm_diag_proxy")
BUFFER = 50_000  # records waiting for the writer; past it they are counted as dropped
BATCH_MAX = 1_000
# The longest a record waits before its batch is written. A batch costs a transaction (its commit
# and a wake of this thread): at 65 records a second, batches of 1 s cost the whole proxy 1.3 %
# less CPU per event than batches of 0.2 s (`benchmarks/side_by_side.py`). Whatever reads the
# history through the proxy waits for what was answered before it (`settle`).
FLUSH_S = 1.0
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0
SETTLE_S = 2.0  # the longest a listing waits for the records before it to be written
ABORT_WAIT_S = 1.0  # at shutdown, after a write that hangs was cut: the writer's time to give up


class History(Observer):
    """The writer (an observer) and the reader of one history database."""

    def __init__(self, target: str, *, max_age_s: float, max_bytes: int, metrics: Any = None,
                 page_limit: int | None = None, password: str | None = None, buffer: int = BUFFER,
                 retains: bool = True, compact: CompactOnce | None = None,
                 on_handed: Callable[[], None] = lambda: None, on_kept: Callable[[int], None] = lambda n: None,
                 ) -> None:
        """`retains`: this writer applies the retention (one of the writers that share a database);
        `compact`: the delivery's one compact dict per record; `on_handed`, `on_kept`: a record went
        into the buffer (the event loop's thread), records left it written or dropped (the writer's)."""
        self.source = HistorySource(target, password)
        self.backend: Backend = self.source.backend(page_limit=page_limit)
        self.retention_every_s = self.source.retention_every_s
        self.retains = retains
        self._compact = compact if compact is not None else CompactOnce()
        self._on_handed, self._on_kept = on_handed, on_kept
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self.buffer = buffer
        self._metrics = metrics
        # The buffer: appended to by the event loop without a lock or a wake-up (a deque's append and
        # popleft are atomic); the writer looks every FLUSH_S, or at once when a batch is full or a
        # listing waits. A lock and a wake-up per record cost the loop more than the write itself.
        self._pending: deque[tuple[ResponseRecord, dict[str, Any]]] = deque()  # with its compact dict
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.up = False
        self.dropped = 0
        self.written = 0
        self._handed = 0  # records put in the buffer (on the event loop's thread)
        self._settled = 0  # of those, written or counted as dropped (on the writer's thread)
        self._progress = threading.Condition()
        self._failing: str | None = None
        self._retained_at = 0.0

    @property
    def shown(self) -> str:
        """Where the history is, as it may be shown (a URL's password hidden)."""
        return self.source.shown

    # --- lifecycle ----------------------------------------------------------------------------
    def open(self) -> bool:
        """Open the database and start the writer. False (logged) when it cannot be opened now: a
        file stays down (memory only); a database server is tried again in the background."""
        connected = True
        try:
            self.backend.connect()
        except HistoryError as exc:
            connected = False
            self._failed("history_unavailable", str(exc))
            if not self.backend.reconnects:
                return False
        if connected:
            self._set_up(True)
        self._thread = threading.Thread(target=self._run, args=(connected,), name="llm-diag-history", daemon=True)
        self._thread.start()
        return connected

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is buffered (bounded by `timeout_s`) and stop the writer; a write still waiting on
        the database then is cut short. What could not be written is counted as dropped and said in one
        log line, with the number."""
        if self._thread is None:
            return
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # a database that does not answer: end the write it waits on
            self.backend.abort()
            self._thread.join(ABORT_WAIT_S)
        self._thread = None
        left = self._handed - self._settled
        if left > 0:
            self._dropped(left)
            _log.error("history_records_lost", history=self.shown, records=left,
                       note=f"the history could not take them within {timeout_s:g} s of the shutdown; they are "
                            "counted in llm_proxy_history_dropped_total")

    # --- the observer -------------------------------------------------------------------------
    def on_response(self, record: ResponseRecord) -> None:
        if self._thread is None:
            return
        pending = self._pending
        if len(pending) >= self.buffer:
            self._dropped(1)
            return
        pending.append((record, self._compact.compact(record)))  # (made once for the log line too)
        self._handed += 1
        self._on_handed()
        if len(pending) == BATCH_MAX:
            self._wake.set()

    def settle(self, timeout_s: float = SETTLE_S) -> bool:
        """Wait until what was handed to the writer before this call is written or counted as
        dropped; False when that did not happen within `timeout_s` (or the writer is down)."""
        target = self._handed
        if self._thread is None or not self.up:
            return False
        if self._settled >= target:
            return True
        self._wake.set()
        with self._progress:
            return self._progress.wait_for(lambda: self._settled >= target, timeout_s)

    # --- the writer thread --------------------------------------------------------------------
    def _run(self, connected: bool) -> None:
        backoff = BACKOFF_MIN_S
        batch: list[tuple[ResponseRecord, dict[str, Any]]] = []
        stopping = False
        while True:
            if not connected:
                if stopping or self._stopping.wait(backoff):
                    break
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                try:
                    self.backend.connect()
                except HistoryError as exc:
                    self._failed("history_write_failed", str(exc))
                    continue
                connected, backoff = True, BACKOFF_MIN_S
                self._recovered()
            if not batch:
                batch, stopping = self._collect()
            if batch:
                try:
                    self.backend.write([record for record, _ in batch], [body for _, body in batch])
                except Unavailable as exc:  # kept: written once the database answers again
                    connected = False
                    self._failed("history_write_failed", str(exc))
                    continue
                except Exception as exc:  # refused (Rejected), or not the database's doing: one at a time
                    written = self._one_by_one(batch)
                    self._done(written, len(batch) - written)
                    if written < len(batch):
                        self._failed("history_write_failed", str(exc) if isinstance(exc, Rejected)
                                     else f"{type(exc).__name__}: {exc}")
                    else:
                        self._recovered()
                else:
                    self._done(len(batch), 0)
                    self._recovered()
                batch = []
            try:
                self._retain()
            except Unavailable as exc:
                connected = False
                self._failed("history_write_failed", str(exc))
            except Exception as exc:  # Rejected, or not the database's doing
                self._failed("history_write_failed", f"{type(exc).__name__}: {exc}")
            if stopping:
                break
        self.backend.close()

    def _one_by_one(self, batch: list[tuple[ResponseRecord, dict[str, Any]]]) -> int:
        """A batch the database refused, written one record at a time: one bad record costs only
        itself, not the other clients' records beside it. Returns how many were written."""
        if len(batch) == 1:
            return 0
        written = 0
        for record, body in batch:
            try:
                self.backend.write([record], [body])
            except Unavailable:
                return written  # (the rest: counted with the batch; the writer reconnects on its next one)
            except Exception:  # this record's own fault: counted with the batch's dropped
                continue
            written += 1
        return written

    def _collect(self) -> tuple[list[tuple[ResponseRecord, dict[str, Any]]], bool]:
        """The next batch: what is buffered after FLUSH_S (or at once when woken: a full batch, a
        listing that waits, the stop), at most BATCH_MAX; and whether the writer is to stop."""
        pending = self._pending
        if len(pending) < BATCH_MAX:
            self._wake.wait(FLUSH_S)
        self._wake.clear()
        batch = [pending.popleft() for _ in range(min(len(pending), BATCH_MAX))]
        return batch, self._stopping.is_set() and not pending

    def _done(self, written: int, dropped: int) -> None:
        self.written += written
        if dropped:
            self._dropped(dropped)
        with self._progress:
            self._settled += written + dropped
            self._progress.notify_all()
        self._on_kept(written + dropped)

    def _retain(self) -> None:
        now = time.monotonic()
        if not self.retains or now - self._retained_at < self.retention_every_s:
            return
        self._retained_at = now
        self.backend.retain(self.max_age_s, self.max_bytes)

    def _failed(self, event: str, error: str) -> None:
        """One log line when writing starts failing (not one per batch or per retry)."""
        if self._failing is None:
            note = ("records wait in a bounded buffer (--history-buffer) while the writer reconnects; past it they "
                    "are counted as dropped (llm_proxy_history_dropped); the proxy keeps serving"
                    if self.backend.reconnects else
                    "records it cannot take are counted as dropped (llm_proxy_history_dropped); the in-memory ring "
                    "still answers and the proxy keeps serving")
            _log.error(event, history=self.shown, error=error[:300], note=note)
        self._failing = error
        self._set_up(False)

    def _recovered(self) -> None:
        if self._failing is not None:
            _log.info("history_recovered", history=self.shown, note="records are written again")
            self._failing = None
        self._set_up(True)

    def _dropped(self, count: int) -> None:
        self.dropped += count
        if self._metrics is not None:
            self._metrics.history_dropped.inc(count)

    def _set_up(self, up: bool) -> None:
        self.up = up
        if self._metrics is not None:
            self._metrics.history_up.set(1 if up else 0)

    # --- reading (each read opens its own connection) -------------------------------------------
    def page(self, query: RecordQuery) -> Page:
        """The newest matching records older than the query's cursor (a row number), as RecordStore.page."""
        return self.backend.page(query)

    def get(self, request_id: str) -> ResponseRecord | None:
        return self.backend.get(request_id)

    def between(self, since: float | None, until: float | None = None, limit: int = 200_000) -> list[ResponseRecord]:
        """Records started in [since, until), oldest first (for diagnose)."""
        return list(self.iterate(RecordQuery(since=since, until=until), limit))

    def iterate(self, query: RecordQuery, limit: int) -> Iterator[ResponseRecord]:
        return self.backend.iterate(query, limit)

    def count(self) -> int:
        return self.backend.count()

    def size_bytes(self) -> int:
        return self.backend.size_bytes()
