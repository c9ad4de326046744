"""History: every record in an embedded SQLite database that outlives the process.

An observer like the others: `on_response` puts the record on a bounded queue and returns; one
thread of its own writes them in batches (one transaction per batch, WAL), so the event loop
never waits on the disk. Retention by age and by size runs on that thread too. Reads
(`/api/requests`, `diagnose`) open their own read-only connection, in a thread.

A disk that is full or read-only, or a database that cannot be opened, is one clear log line,
`llm_proxy_history_up 0` and a count of the records not kept; the proxy keeps serving, and the
in-memory ring still answers. When writes succeed again, one line says so.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import structlog

from proxy.observers.hooks import Observer
from proxy.observers.record_store import Page, RecordQuery
from proxy.record import ResponseRecord, concurrency_bucket, record_from_dict

_log = structlog.get_logger("llm_diag_proxy")
QUEUE_MAX = 50_000  # records waiting for the writer; past it they are counted as dropped
BATCH_MAX = 1_000
FLUSH_S = 0.2  # the longest a record waits before its batch is written
RETENTION_EVERY_S = 10.0
SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    request_id TEXT NOT NULL,
    upstream_request_id TEXT,
    started_at REAL NOT NULL,
    model TEXT, route TEXT, stop_reason TEXT, length_cause TEXT, cause TEXT, outcome TEXT,
    concurrency TEXT, body BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS records_started_at ON records (started_at);
CREATE INDEX IF NOT EXISTS records_request_id ON records (request_id);
"""
COLUMNS = ("request_id", "upstream_request_id", "started_at", "model", "route", "stop_reason", "length_cause",
           "cause", "outcome", "concurrency", "body")
FILTERS = ("stop_reason", "model", "route", "length_cause", "cause", "outcome", "concurrency")


def default_path() -> str:
    """$XDG_STATE_HOME/llm-diag-proxy/history.sqlite3, else ~/.local/state/llm-diag-proxy/history.sqlite3."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "llm-diag-proxy", "history.sqlite3")


def make_private(path: str) -> None:
    """The database, and the WAL and shared-memory files SQLite keeps beside it, readable by their
    owner only: they hold the paths, models and timings of everyone's requests. SQLite creates its
    -wal and -shm files with the database file's own mode (os_unix.c, findCreateFileMode), so the
    database is created 0600 before SQLite opens it, and files left more open by an older version
    are closed down."""
    flags = os.O_CREAT | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)
    os.close(os.open(path, flags, 0o600))
    for name in (path, path + "-wal", path + "-shm"):
        with contextlib.suppress(FileNotFoundError):
            mode = os.stat(name).st_mode & 0o777
            if mode & 0o077:
                os.chmod(name, mode & 0o700)


def _row(record: ResponseRecord) -> tuple[Any, ...]:
    body = record.to_dict()
    return (record.request_id, record.upstream_request_id, record.started_at, record.model, record.route,
            record.stop_reason, record.length_cause, body["cause"], body["outcome"],
            concurrency_bucket(record.concurrency_peak), orjson.dumps(body, default=str))


def _connect(path: str) -> sqlite3.Connection:
    """The writer's connection: incremental auto-vacuum (so that retention gives space back; set
    before anything else, and once with a VACUUM on a database made without it), WAL, and
    NORMAL sync (a power cut may lose the last batches, never the database)."""
    connection = sqlite3.connect(path, timeout=5.0, isolation_level=None, check_same_thread=False)
    connection.execute("PRAGMA auto_vacuum=INCREMENTAL")
    if connection.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:
        connection.execute("VACUUM")
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=NORMAL")
    return connection


class History(Observer):
    """The writer (an observer) and the reader of one history database."""

    def __init__(self, path: str, *, max_age_s: float, max_bytes: int, metrics: Any = None,
                 page_limit: int | None = None) -> None:
        self.path = path
        self.retention_every_s = RETENTION_EVERY_S
        self._page_limit = page_limit  # SQLite's max_page_count: a full disk, for tests
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self._metrics = metrics
        self._queue: queue.Queue[ResponseRecord | None] = queue.Queue(QUEUE_MAX)
        self._thread: threading.Thread | None = None
        self.up = False
        self.dropped = 0
        self.written = 0
        self._failing: str | None = None
        self._retained_at = 0.0

    # --- lifecycle ----------------------------------------------------------------------------
    def open(self) -> bool:
        """Create or open the database and start the writer; False (logged) when it cannot."""
        try:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            make_private(self.path)
            connection = _connect(self.path)
            connection.executescript(SCHEMA)
            if self._page_limit is not None:
                connection.execute(f"PRAGMA max_page_count={int(self._page_limit)}")
        except (OSError, sqlite3.Error) as exc:
            _log.error("history_unavailable", path=self.path, error=str(exc)[:300],
                       note="records are kept in memory only (the ring); the proxy keeps serving")
            self._set_up(False)
            return False
        self._set_up(True)
        self._thread = threading.Thread(target=self._write_loop, args=(connection,), name="llm-diag-history",
                                        daemon=True)
        self._thread.start()
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (bounded by `timeout_s`) and stop the writer."""
        if self._thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self._thread.join(timeout_s)
        self._thread = None

    # --- the observer -------------------------------------------------------------------------
    def on_response(self, record: ResponseRecord) -> None:
        if self._thread is None:
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self._dropped(1)

    # --- the writer thread --------------------------------------------------------------------
    def _write_loop(self, connection: sqlite3.Connection) -> None:
        stopping = False
        while not stopping:
            batch: list[ResponseRecord] = []
            try:
                first = self._queue.get(timeout=1.0)
            except queue.Empty:
                self._retain(connection)
                continue
            deadline = time.monotonic() + FLUSH_S
            item: ResponseRecord | None = first
            while True:
                if item is None:
                    stopping = True
                    break
                batch.append(item)
                if len(batch) >= BATCH_MAX:
                    break
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
            if batch:
                self._write(connection, batch)
            self._retain(connection)
        connection.close()

    def _write(self, connection: sqlite3.Connection, batch: list[ResponseRecord]) -> None:
        try:
            rows = [_row(record) for record in batch]
            connection.execute("BEGIN")
            connection.executemany(
                f"INSERT INTO records ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})", rows)
            connection.execute("COMMIT")
        except (sqlite3.Error, OSError, ValueError) as exc:
            with_rollback(connection)
            self._dropped(len(batch))
            self._failed(str(exc))
            return
        self.written += len(batch)
        if self._failing is not None:
            _log.info("history_recovered", path=self.path, note="records are written again")
            self._failing = None
        self._set_up(True)

    def _retain(self, connection: sqlite3.Connection) -> None:
        now = time.monotonic()
        if now - self._retained_at < self.retention_every_s:
            return
        self._retained_at = now
        try:
            if self.max_age_s > 0:
                connection.execute("DELETE FROM records WHERE started_at < ?", (time.time() - self.max_age_s,))
            trimmed = False
            while self.max_bytes > 0 and _used_bytes(connection) > self.max_bytes:
                rows = connection.execute("SELECT COUNT(*) FROM records").fetchone()[0]
                if not rows:
                    break
                connection.execute("DELETE FROM records WHERE seq IN (SELECT seq FROM records ORDER BY seq LIMIT ?)",
                                   (max(1, rows // 10),))
                trimmed = True
            if trimmed or self.max_age_s > 0:
                connection.executescript("PRAGMA incremental_vacuum;")  # execute() would free one page only
                connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except (sqlite3.Error, OSError) as exc:
            self._failed(str(exc))

    def size_bytes(self) -> int:
        return sum(os.path.getsize(p) for p in (self.path, self.path + "-wal") if os.path.exists(p))

    def _failed(self, error: str) -> None:
        if self._failing is None:
            _log.error("history_write_failed", path=self.path, error=error[:300],
                       note="records are kept in memory only until writes succeed; the proxy keeps serving")
        self._failing = error
        self._set_up(False)

    def _dropped(self, count: int) -> None:
        self.dropped += count
        if self._metrics is not None:
            self._metrics.history_dropped.inc(count)

    def _set_up(self, up: bool) -> None:
        self.up = up
        if self._metrics is not None:
            self._metrics.history_up.set(1 if up else 0)

    # --- reading ------------------------------------------------------------------------------
    def _reader(self) -> sqlite3.Connection:
        return sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=5.0)

    def page(self, query: RecordQuery) -> Page:
        """The newest matching records older than the query's cursor (a `seq`), as RecordStore.page."""
        where, args = _where(query)
        sql = f"SELECT seq, body FROM records {where} ORDER BY seq DESC LIMIT ?"
        connection = self._reader()
        try:
            rows = connection.execute(sql, (*args, query.limit + 1)).fetchall()
        finally:
            connection.close()
        records = [record_from_dict(orjson.loads(body)) for _, body in rows[:query.limit]]
        next_cursor = rows[query.limit - 1][0] if len(rows) > query.limit else None
        return Page(records, next_cursor)

    def get(self, request_id: str) -> ResponseRecord | None:
        connection = self._reader()
        try:
            row = connection.execute("SELECT body FROM records WHERE request_id = ? OR upstream_request_id = ? "
                                     "ORDER BY seq DESC LIMIT 1", (request_id, request_id)).fetchone()
        finally:
            connection.close()
        return record_from_dict(orjson.loads(row[0])) if row else None

    def between(self, since: float | None, until: float | None = None, limit: int = 200_000) -> list[ResponseRecord]:
        """Records started in [since, until), oldest first (for diagnose)."""
        return list(self.iterate(RecordQuery(since=since, until=until), limit))

    def iterate(self, query: RecordQuery, limit: int) -> Iterator[ResponseRecord]:
        where, args = _where(query)
        connection = self._reader()
        try:
            rows = connection.execute(f"SELECT body FROM records {where} ORDER BY seq LIMIT ?", (*args, limit))
            for (body,) in rows:
                yield record_from_dict(orjson.loads(body))
        finally:
            connection.close()

    def count(self) -> int:
        connection = self._reader()
        try:
            return int(connection.execute("SELECT COUNT(*) FROM records").fetchone()[0])
        finally:
            connection.close()


def _used_bytes(connection: sqlite3.Connection) -> int:
    """Pages in use (the free list left out), as the size limit counts them."""
    pages = connection.execute("PRAGMA page_count").fetchone()[0]
    free = connection.execute("PRAGMA freelist_count").fetchone()[0]
    return int((pages - free) * connection.execute("PRAGMA page_size").fetchone()[0])


def with_rollback(connection: sqlite3.Connection) -> None:
    with contextlib.suppress(sqlite3.Error):
        connection.execute("ROLLBACK")


def _where(query: RecordQuery) -> tuple[str, tuple[Any, ...]]:
    clauses: list[str] = []
    args: list[Any] = []
    for name in FILTERS:
        value = getattr(query, name)
        if value is not None:
            clauses.append(f"{name} = ?")
            args.append(value)
    if query.since is not None:
        clauses.append("started_at >= ?")
        args.append(query.since)
    if query.until is not None:
        clauses.append("started_at < ?")
        args.append(query.until)
    if query.cursor is not None:
        clauses.append("seq < ?")
        args.append(query.cursor)
    return ("WHERE " + " AND ".join(clauses) if clauses else ""), tuple(args)
