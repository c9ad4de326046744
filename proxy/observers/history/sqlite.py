"""The embedded history: one SQLite file per proxy (WAL, incremental auto-vacuum), private to its owner.

Retention by age and by size (pages in use, the free list left out). A database made by an older
version (no `instance` and `upstream` columns) gets them added when it is opened for writing.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from proxy.observers.history.backend import (
    COLUMNS,
    HistoryReadError,
    Queries,
    Rejected,
    page_from_rows,
    record_from_body,
    records_of,
    rows_of,
)
from proxy.observers.record_store import Page, RecordQuery
from proxy.record import ResponseRecord

SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    request_id TEXT NOT NULL,
    upstream_request_id TEXT,
    started_at REAL NOT NULL,
    model TEXT, route TEXT, stop_reason TEXT, length_cause TEXT, cause TEXT, outcome TEXT,
    concurrency TEXT, body BLOB NOT NULL,
    instance TEXT, upstream TEXT, client TEXT
);
CREATE INDEX IF NOT EXISTS records_started_at ON records (started_at);
CREATE INDEX IF NOT EXISTS records_request_id ON records (request_id);
"""
# After the columns of an older database are added: the key that makes a write idempotent.
KEY = ("CREATE UNIQUE INDEX IF NOT EXISTS records_key ON records (instance, request_id, started_at);"
       "CREATE INDEX IF NOT EXISTS records_upstream_request_id ON records (upstream_request_id);")
QUERIES = Queries("records", "body", "?")
INSERT = f"INSERT OR IGNORE INTO records ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"


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


class SQLiteBackend:
    """One SQLite file: the writer's connection, and a read-only connection per read."""

    reconnects = False  # a file that cannot be opened now is a path to fix: said once, memory only

    def __init__(self, path: str, page_limit: int | None = None) -> None:
        self.path = path
        self.shown = path
        self._page_limit = page_limit  # SQLite's max_page_count: a full disk, for tests
        self._connection: sqlite3.Connection | None = None
        self.skipped = [0]  # rows read that hold no record this version can read

    # --- the writer -----------------------------------------------------------------------------
    def connect(self) -> None:
        """Incremental auto-vacuum (so that retention gives space back; set before anything else,
        and once with a VACUUM on a database made without it), WAL, and NORMAL sync (a power cut
        may lose the last batches, never the database)."""
        try:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            make_private(self.path)
            connection = sqlite3.connect(self.path, timeout=5.0, isolation_level=None, check_same_thread=False)
            connection.execute("PRAGMA auto_vacuum=INCREMENTAL")
            if connection.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:
                connection.execute("VACUUM")
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")
            connection.executescript(SCHEMA)
            have = {row[1] for row in connection.execute("PRAGMA table_info(records)")}
            for column in ("instance", "upstream", "client"):
                if column not in have:
                    connection.execute(f"ALTER TABLE records ADD COLUMN {column} TEXT")
            connection.executescript(KEY)
            if self._page_limit is not None:
                connection.execute(f"PRAGMA max_page_count={int(self._page_limit)}")
        except (OSError, sqlite3.Error) as exc:
            raise Rejected(str(exc)[:300]) from None
        self._connection = connection

    def write(self, records: list[ResponseRecord], bodies: list[dict[str, Any]] | None = None) -> None:
        connection = self._writer()
        try:
            rows = rows_of(records, bodies)
            connection.execute("BEGIN")
            connection.executemany(INSERT, rows)
            connection.execute("COMMIT")
        except (sqlite3.Error, OSError, ValueError) as exc:
            with contextlib.suppress(sqlite3.Error):
                connection.execute("ROLLBACK")
            raise Rejected(str(exc)[:300]) from None

    def retain(self, max_age_s: float, max_bytes: int) -> None:
        connection = self._writer()
        try:
            if max_age_s > 0:
                connection.execute("DELETE FROM records WHERE started_at < ?", (time.time() - max_age_s,))
            trimmed = False
            while max_bytes > 0 and _used_bytes(connection) > max_bytes:
                rows = connection.execute("SELECT COUNT(*) FROM records").fetchone()[0]
                if not rows:
                    break
                connection.execute("DELETE FROM records WHERE seq IN (SELECT seq FROM records ORDER BY seq LIMIT ?)",
                                   (max(1, rows // 10),))
                trimmed = True
            if trimmed or max_age_s > 0:
                connection.executescript("PRAGMA incremental_vacuum;")  # execute() would free one page only
                connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except (sqlite3.Error, OSError) as exc:
            raise Rejected(str(exc)[:300]) from None

    def close(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(sqlite3.Error):
                self._connection.close()
            self._connection = None

    def abort(self) -> None:
        """Nothing to end from outside: a write to a local file does not wait on another party."""

    def _writer(self) -> sqlite3.Connection:
        if self._connection is None:
            self.connect()
        assert self._connection is not None
        return self._connection

    # --- reading --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _reader(self) -> Iterator[sqlite3.Connection]:
        try:
            connection = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=5.0)
        except sqlite3.Error as exc:
            raise HistoryReadError(f"cannot read the history at {self.path}: {exc}") from None
        try:
            yield connection
        except sqlite3.Error as exc:
            raise HistoryReadError(f"cannot read the history at {self.path}: {exc}") from None
        finally:
            connection.close()

    def page(self, query: RecordQuery) -> Page:
        with self._reader() as connection:
            rows = connection.execute(*QUERIES.page(query)).fetchall()
        return page_from_rows(rows, query.limit)

    def get(self, request_id: str) -> ResponseRecord | None:
        with self._reader() as connection:
            row = connection.execute(*QUERIES.get(request_id)).fetchone()
        return record_from_body(row[0]) if row else None

    def iterate(self, query: RecordQuery, limit: int) -> Iterator[ResponseRecord]:
        with self._reader() as connection:
            yield from records_of((body for (body,) in connection.execute(*QUERIES.iterate(query, limit))),
                                  self.skipped)

    def count(self) -> int:
        with self._reader() as connection:
            return int(connection.execute(QUERIES.count()).fetchone()[0])

    def size_bytes(self) -> int:
        return sum(os.path.getsize(p) for p in (self.path, self.path + "-wal") if os.path.exists(p))


def _used_bytes(connection: sqlite3.Connection) -> int:
    """Pages in use (the free list left out), as the size limit counts them."""
    pages = connection.execute("PRAGMA page_count").fetchone()[0]
    free = connection.execute("PRAGMA freelist_count").fetchone()[0]
    return int((pages - free) * connection.execute("PRAGMA page_size").fetchone()[0])
