"""What every history backend does, and the row both keep.

A backend holds records in one table, `records`: the columns the queries filter on, and the whole
record as JSON. Both backends answer the same queries (filters, since/until, a cursor, retention)
from the same WHERE clause, built here with their placeholder. A write is idempotent on
(instance, request_id, started_at): a batch sent again after its commit went unconfirmed adds
nothing, while a client that reuses its X-Request-Id for a new request still gets a new record
(the request id alone would fold the two into one).

Errors a backend raises, so that the writer knows what to do with a batch:
- `Unavailable`: the database cannot be reached now (down, restarting, a wrong password); the
  writer keeps the batch, reconnects with backoff, and records wait in its bounded buffer;
- `Rejected`: the database refused the batch itself (a full disk, a bad value); the batch is
  dropped and counted, and the next is tried.
Reads raise `HistoryReadError`, whose message never holds a password.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from proxy.observers.record_store import Page, RecordQuery
from proxy.record import ResponseRecord, concurrency_bucket

# The columns of a row, in order; `body` is the record as JSON with its None fields left out.
COLUMNS = ("instance", "upstream", "client", "request_id", "upstream_request_id", "started_at", "model", "route",
           "stop_reason", "length_cause", "cause", "outcome", "concurrency", "body")
# The exact-match filters of RecordQuery, each a column.
FILTERS = ("stop_reason", "model", "route", "length_cause", "cause", "outcome", "concurrency", "instance",
           "upstream", "client")
MAX_TEXT = 512  # a column value longer than this is cut (the body keeps the record whole)


class HistoryError(Exception):
    """A history backend's failure, its message safe to show (no password in it)."""


class Unavailable(HistoryError):
    """The database cannot be reached now: keep the batch and try again later."""


class Rejected(HistoryError):
    """The database refused the batch: drop it, count it, go on."""


class HistoryReadError(HistoryError):
    """A read of the history failed."""


class Backend(Protocol):
    """One history database: written by the writer thread, read by admin readers and `diagnose`."""

    shown: str  # where it is, as it may be shown (a URL's password replaced by ***)
    reconnects: bool  # True: when it cannot be opened, the writer keeps trying (a server may come back)
    skipped: list[int]  # [rows iterated that hold no record this version can read]

    def connect(self) -> None:
        """Open the writer's connection and make the schema; Unavailable or Rejected when it cannot."""
        ...

    def write(self, records: list[ResponseRecord], bodies: list[dict[str, Any]] | None = None) -> None:
        """Insert a batch in one transaction, idempotently (`bodies`: the records' compact dicts, when
        made already); Unavailable or Rejected when it cannot."""
        ...

    def retain(self, max_age_s: float, max_bytes: int) -> None:
        """Delete what is older than `max_age_s` (0: keep) and, where the backend can, the oldest past
        `max_bytes` (0: no limit)."""
        ...

    def close(self) -> None:
        """Close the writer's connection (safe to call when it is not open)."""
        ...

    def abort(self) -> None:
        """From another thread: end at once whatever the writer waits on (a server that never answers)."""
        ...

    def page(self, query: RecordQuery) -> Page:
        """The newest matching records older than the query's cursor (a row number), as RecordStore.page."""
        ...

    def get(self, request_id: str) -> ResponseRecord | None:
        """The newest record with this id (the proxy's, or the upstream's own)."""
        ...

    def iterate(self, query: RecordQuery, limit: int) -> Iterator[ResponseRecord]:
        """Matching records, oldest first, at most `limit`."""
        ...

    def count(self) -> int:
        ...

    def size_bytes(self) -> int:
        """What the records take on disk."""
        ...


def rows_of(records: list[ResponseRecord], bodies: list[dict[str, Any]] | None) -> list[tuple[Any, ...]]:
    """The rows of a batch (`bodies`: the records' compact dicts, made once per delivery)."""
    if bodies is None:
        return [row_of(record) for record in records]
    return [row_of(record, body) for record, body in zip(records, bodies, strict=True)]


def row_of(record: ResponseRecord, body: dict[str, Any] | None = None) -> tuple[Any, ...]:
    """The row of a record: its query columns and its body (`body`: its compact dict, if made)."""
    if body is None:
        body = record.to_compact_dict()
    return (_text(record.instance) or "", _text(record.upstream), _text(record.client), _text(record.request_id),
            _text(record.upstream_request_id), record.started_at, _text(record.model), _text(record.route),
            record.stop_reason, record.length_cause, body["cause"], body["outcome"],
            concurrency_bucket(record.concurrency_peak), orjson.dumps(body, default=str))


def _text(value: str | None) -> str | None:
    return value if value is None or len(value) <= MAX_TEXT else value[:MAX_TEXT]


def where(query: RecordQuery, mark: str) -> tuple[str, tuple[Any, ...]]:
    """The WHERE clause of a query (empty when it has no condition) and its arguments; `mark` is
    the backend's placeholder (`?` or `%s`)."""
    clauses: list[str] = []
    args: list[Any] = []
    for name in FILTERS:
        value = getattr(query, name)
        if value is not None:
            clauses.append(f"{name} = {mark}")
            args.append(value)
    for condition, value in (("started_at >=", query.since), ("started_at <", query.until), ("seq <", query.cursor)):
        if value is not None:
            clauses.append(f"{condition} {mark}")
            args.append(value)
    return ("WHERE " + " AND ".join(clauses) if clauses else ""), tuple(args)


@dataclass(frozen=True, slots=True)
class Queries:
    """The reads every backend answers, written once: its table, how its body column reads as JSON
    text, and its placeholder (`?` or `%s`). Each returns the SQL and its arguments."""

    table: str
    body: str
    mark: str

    def page(self, query: RecordQuery) -> tuple[str, tuple[Any, ...]]:
        """`limit + 1` rows of (seq, body), newest first (see page_from_rows)."""
        clause, args = where(query, self.mark)
        return (f"SELECT seq, {self.body} FROM {self.table} {clause} ORDER BY seq DESC LIMIT {self.mark}",
                (*args, query.limit + 1))

    def get(self, request_id: str) -> tuple[str, tuple[Any, ...]]:
        """The newest body with this id, the proxy's or the upstream's own."""
        return (f"SELECT {self.body} FROM {self.table} WHERE request_id = {self.mark} OR upstream_request_id = "
                f"{self.mark} ORDER BY seq DESC LIMIT 1", (request_id, request_id))

    def iterate(self, query: RecordQuery, limit: int) -> tuple[str, tuple[Any, ...]]:
        """Bodies oldest first, at most `limit`."""
        clause, args = where(query, self.mark)
        return f"SELECT {self.body} FROM {self.table} {clause} ORDER BY seq LIMIT {self.mark}", (*args, limit)

    def count(self) -> str:
        return f"SELECT COUNT(*) FROM {self.table}"


def page_from_rows(rows: list[tuple[int, Any]], limit: int) -> Page:
    """A page from `limit + 1` rows of (seq, body), newest first: the extra row says another page follows.
    A row that holds no record this version can read is left out and counted (`skipped`)."""
    found = [record_from_body(body) for _, body in rows[:limit]]
    records = [record for record in found if record is not None]
    return Page(records, rows[limit - 1][0] if len(rows) > limit else None, len(found) - len(records))


def record_from_body(body: Any) -> ResponseRecord | None:
    """A record from its stored body (JSON bytes or text, or a dict a driver already decoded), as far
    as this version can read it (`record_from_stored`); None for a row that holds no record."""
    from proxy.record import record_from_stored

    if isinstance(body, dict):
        return record_from_stored(body)
    try:
        return record_from_stored(orjson.loads(body))
    except (orjson.JSONDecodeError, TypeError):
        return None


def records_of(bodies: Iterator[Any], skipped: list[int]) -> Iterator[ResponseRecord]:
    """The records of stored bodies, those no record can be read from counted in `skipped[0]`."""
    for body in bodies:
        record = record_from_body(body)
        if record is None:
            skipped[0] += 1
        else:
            yield record
