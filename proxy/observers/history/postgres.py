"""The fleet's history: one PostgreSQL that every proxy writes to (psycopg 3), `--history postgresql://…`.

One table, `llm_diag_records`, made by the first proxy that connects (under an advisory lock,
so that proxies starting together do not race). A batch is one COPY of the records' JSON into a
staging table, then one INSERT that takes the query columns from it, `ON CONFLICT DO NOTHING` on
(instance, request_id, started_at). The body is JSONB, so an operator can ask the records anything
in SQL.

The password comes from the URL, from `PGPASSWORD` or `~/.pgpass` (libpq reads them), or from a
file (`--history-password-file`); it is never shown: errors are scrubbed of it, the URL is shown
with `***`. Retention is by age: each proxy deletes what is older than its `--history-max-age`
(the same rows, whichever proxy it is); the size of a shared database is its operator's to watch.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import orjson
import psycopg

from proxy.config import redact_url
from proxy.observers.history.backend import (
    COLUMNS,
    MAX_TEXT,
    HistoryReadError,
    Queries,
    Rejected,
    Unavailable,
    page_from_rows,
    record_from_body,
    records_of,
)
from proxy.observers.record_store import Page, RecordQuery
from proxy.record import ResponseRecord, concurrency_bucket

TABLE = "llm_diag_records"
SCHEMA_LOCK = 0x6C6C6D64  # pg_advisory_xact_lock key: one proxy makes the schema at a time
CONNECT_TIMEOUT_S = 5  # libpq's: the connection and its startup, a server that accepts and never answers included
STATEMENT_TIMEOUT_MS = 30_000  # the server's own bound on a write or a delete (and retried)
# The client's own bound on each operation: a server whose processes are stopped (its kernel still
# accepts and acknowledges) never answers, and its statement_timeout cannot fire there. Past it the
# connection's socket is shut: libpq fails the call at once, and the writer reconnects with backoff.
WRITE_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 120.0
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    instance TEXT NOT NULL,
    upstream TEXT,
    client TEXT,
    request_id TEXT NOT NULL,
    upstream_request_id TEXT,
    started_at DOUBLE PRECISION NOT NULL,
    model TEXT, route TEXT, stop_reason TEXT, length_cause TEXT, cause TEXT, outcome TEXT, concurrency TEXT,
    body JSONB NOT NULL,
    CONSTRAINT {TABLE}_key UNIQUE (instance, request_id, started_at)
);
ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS client TEXT;
CREATE INDEX IF NOT EXISTS {TABLE}_started_at ON {TABLE} (started_at);
CREATE INDEX IF NOT EXISTS {TABLE}_request_id ON {TABLE} (request_id);
CREATE INDEX IF NOT EXISTS {TABLE}_upstream_request_id ON {TABLE} (upstream_request_id)
    WHERE upstream_request_id IS NOT NULL;
"""
# A batch goes by COPY into a staging table of the session (emptied at each commit), then into the
# table with ON CONFLICT DO NOTHING: COPY is PostgreSQL's fastest way in, and cannot skip conflicts itself.
# A staged row is the record's JSON and its concurrency label; the server takes the query columns from
# the JSON (cut to MAX_TEXT as SQLite's row is), so that the proxy's thread only writes the JSON.
QUERIES = Queries(TABLE, "body::text", "%s")
STAGE = f"{TABLE}_stage"
MAKE_STAGE = f"CREATE TEMP TABLE IF NOT EXISTS {STAGE} (concurrency TEXT, body JSONB) ON COMMIT DELETE ROWS"
COPY = f"COPY {STAGE} (concurrency, body) FROM STDIN"
_FROM_BODY = {
    **{name: f"left(body->>'{name}', {MAX_TEXT})" for name in COLUMNS},
    "instance": f"coalesce(left(body->>'instance', {MAX_TEXT}), '')",
    "started_at": "(body->>'started_at')::double precision",
    **{name: f"body->>'{name}'" for name in ("stop_reason", "length_cause", "cause", "outcome")},
    "concurrency": "concurrency", "body": "body"}
INSERT = (f"INSERT INTO {TABLE} ({', '.join(COLUMNS)}) SELECT {', '.join(_FROM_BODY[name] for name in COLUMNS)} "
          f"FROM {STAGE} ON CONFLICT DO NOTHING")
_NUL_ESCAPE = re.compile(rb"(?<!\\)((?:\\\\)*)\\u0000")


class PostgresBackend:
    """One PostgreSQL database: the writer's connection, and a connection per read."""

    reconnects = True  # a server that is down, restarting or refusing now may answer later

    def __init__(self, url: str, password: str | None = None, write_timeout_s: float = WRITE_TIMEOUT_S,
                 read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.url = url
        self.shown = redact_url(url)
        self._password = password
        self._connection: psycopg.Connection[Any] | None = None
        self.write_timeout_s, self.read_timeout_s = write_timeout_s, read_timeout_s
        self.skipped = [0]  # rows read that hold no record this version can read

    def _connect(self, **options: Any) -> psycopg.Connection[Any]:
        extra: dict[str, Any] = {"password": self._password} if self._password is not None else {}
        return psycopg.connect(self.url, connect_timeout=CONNECT_TIMEOUT_S, application_name="llm-diag-proxy",
                               client_encoding="utf8",  # what copy_data writes, whatever the database's own
                               keepalives=1, keepalives_idle=10, keepalives_interval=5, keepalives_count=3,
                               **extra, **options)

    def _safe(self, exc: BaseException) -> str:
        """An error's message, one line, without the password (libpq's do not show it; made sure)."""
        text = " ".join(str(exc).split())[:300] or type(exc).__name__
        for secret in (self._password, _password_of(self.url)):
            if secret:
                text = text.replace(secret, "***")
        return redact_url(text)

    # --- the writer -----------------------------------------------------------------------------
    def connect(self) -> None:
        self.close()
        try:
            connection = self._connect(options=f"-c statement_timeout={STATEMENT_TIMEOUT_MS}")
            with deadline(connection, self.write_timeout_s), connection.transaction():
                connection.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
                connection.execute(SCHEMA)
                connection.execute(MAKE_STAGE)
        except psycopg.Error as exc:
            raise self._failure(exc) from None
        self._connection = connection

    def write(self, records: list[ResponseRecord], bodies: list[dict[str, Any]] | None = None) -> None:
        if self._connection is None:
            self.connect()
        assert self._connection is not None
        data = copy_data(records, bodies)
        try:
            with deadline(self._connection, self.write_timeout_s), self._connection.transaction(), \
                    self._connection.cursor() as cursor:
                with cursor.copy(COPY) as copy:
                    copy.write(data)
                cursor.execute(INSERT)
        except psycopg.Error as exc:
            raise self._failure(exc) from None

    def retain(self, max_age_s: float, max_bytes: int) -> None:
        if max_age_s <= 0:
            return
        if self._connection is None:
            self.connect()
        assert self._connection is not None
        try:
            with deadline(self._connection, self.write_timeout_s), self._connection.transaction():
                self._connection.execute(f"DELETE FROM {TABLE} WHERE started_at < %s", (time.time() - max_age_s,))
        except psycopg.Error as exc:
            raise self._failure(exc) from None

    def close(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(psycopg.Error):
                self._connection.close()
            self._connection = None

    def abort(self) -> None:
        """From another thread: end whatever the writer's connection is waiting for, at once."""
        if self._connection is not None:
            cut(self._connection)

    def _failure(self, exc: psycopg.Error) -> Unavailable | Rejected:
        """Unavailable for what may pass (the server down, restarting, refusing the login, slow, or
        the connection gone), Rejected for what the batch itself did."""
        if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
            self.close()
            return Unavailable(self._safe(exc))
        return Rejected(self._safe(exc))

    # --- reading --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _reader(self) -> Iterator[psycopg.Connection[Any]]:
        try:
            connection = self._connect(options=f"-c statement_timeout={STATEMENT_TIMEOUT_MS * 4}")
        except psycopg.Error as exc:
            raise HistoryReadError(f"cannot read the history at {self.shown}: {self._safe(exc)}") from None
        try:
            connection.read_only = True
            with deadline(connection, self.read_timeout_s):
                yield connection
        except psycopg.Error as exc:
            raise HistoryReadError(f"cannot read the history at {self.shown}: {self._safe(exc)}") from None
        finally:
            with contextlib.suppress(psycopg.Error):
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
        with self._reader() as connection, connection.transaction(), connection.cursor(name="records") as cursor:
            cursor.itersize = 2000  # a server-side cursor: 200,000 records are not held at once
            cursor.execute(*QUERIES.iterate(query, limit))
            yield from records_of((body for (body,) in cursor), self.skipped)

    def count(self) -> int:
        with self._reader() as connection:
            row = connection.execute(QUERIES.count()).fetchone()
        return int(row[0]) if row else 0

    def size_bytes(self) -> int:
        with self._reader() as connection:
            row = connection.execute("SELECT pg_total_relation_size(%s)", (TABLE,)).fetchone()
        return int(row[0]) if row and row[0] is not None else 0


def cut(connection: psycopg.Connection[Any]) -> None:
    """Shut a connection's socket (from any thread): a libpq call blocked on it fails at once."""
    with contextlib.suppress(OSError, psycopg.Error, ValueError):
        fileno = connection.pgconn.socket
        with socket.socket(fileno=os.dup(fileno)) as handle:
            handle.shutdown(socket.SHUT_RDWR)


@contextlib.contextmanager
def deadline(connection: psycopg.Connection[Any], seconds: float) -> Iterator[None]:
    """The client's own bound on what runs inside: past `seconds`, the connection's socket is shut
    (`cut`) and the blocked call fails with an OperationalError, read as Unavailable."""
    timer = threading.Timer(seconds, cut, (connection,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _password_of(url: str) -> str | None:
    from urllib.parse import unquote, urlsplit

    try:
        password = urlsplit(url).password
    except ValueError:
        return None
    return unquote(password) if password else None


def copy_data(records: list[ResponseRecord], bodies: list[dict[str, Any]] | None) -> bytes:
    """A batch in COPY's text format, a line per record: its concurrency label, a tab, its JSON.
    JSON has no raw tab, newline or carriage return (orjson escapes them in strings), so the one
    byte COPY reads specially in it is the backslash, doubled here. JSONB refuses the escaped NUL
    that JSON allows: U+FFFD in its place (looked for first: a regex over every body would cost
    more than the rest of the write)."""
    if bodies is None:
        bodies = [record.to_compact_dict() for record in records]
    lines = []
    for record, body in zip(records, bodies, strict=True):
        text = orjson.dumps(body, default=str)
        if b"\\" in text:
            if b"\\u0000" in text:
                text = _NUL_ESCAPE.sub(rb"\1\\ufffd", text)
            text = text.replace(b"\\", b"\\\\")
        lines.append(b"%b\t%b\n" % (concurrency_bucket(record.concurrency_peak).encode(), text))
    return b"".join(lines)
