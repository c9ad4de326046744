"""The record store: the newest records in a bounded ring, findable by request id, read in pages."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from proxy.observers.hooks import Observer
from proxy.record import ResponseRecord, concurrency_bucket

DEFAULT_PAGE = 100
MAX_PAGE = 1000
OWNER_SPAN = 128  # sequence numbers are microseconds x OWNER_SPAN + owner (at most 64 workers and 1)


@dataclass(frozen=True, slots=True)
class RecordQuery:
    """Which records: exact filters (None: any), a time range on `started_at` (unix seconds), and
    a page: up to `limit`, newest first, older than `cursor` (the `next_cursor` of the page before)."""

    stop_reason: str | None = None
    model: str | None = None
    route: str | None = None
    length_cause: str | None = None
    cause: str | None = None  # ResponseRecord.cause: the label of the request metrics
    outcome: str | None = None  # ResponseRecord.outcome: complete, budget, cut, ...
    concurrency: str | None = None  # the bucket of concurrency_peak: 1, 2, 4, ..., 128+
    instance: str | None = None  # the proxy that saw it (a fleet's shared history)
    upstream: str | None = None  # the server it went to
    client: str | None = None  # who sent it (ResponseRecord.client)
    since: float | None = None
    until: float | None = None
    cursor: int | None = None
    limit: int = DEFAULT_PAGE

    def matches(self, record: ResponseRecord) -> bool:
        return ((self.stop_reason is None or record.stop_reason == self.stop_reason)
                and (self.model is None or record.model == self.model)
                and (self.route is None or record.route == self.route)
                and (self.length_cause is None or record.length_cause == self.length_cause)
                and (self.cause is None or record.cause == self.cause)
                and (self.outcome is None or record.outcome == self.outcome)
                and (self.concurrency is None or concurrency_bucket(record.concurrency_peak) == self.concurrency)
                and (self.instance is None or record.instance == self.instance)
                and (self.upstream is None or record.upstream == self.upstream)
                and (self.client is None or record.client == self.client)
                and (self.since is None or record.started_at >= self.since)
                and (self.until is None or record.started_at < self.until))


@dataclass(frozen=True, slots=True)
class Page:
    records: list[ResponseRecord]
    next_cursor: int | None  # None: this was the last page
    skipped: int = 0  # rows of the history that hold no record this version can read (counted, left out)


class RecordStore(Observer):
    """Keeps the last `capacity` records (an observer: it stores each finished record).

    Each record gets a sequence number as it is stored; a cursor is one, so pages stay put while
    new records arrive. The numbers are the microsecond it was stored times OWNER_SPAN, plus the
    `owner` (the worker; 0 alone), and rise within one store: the rings of N workers read as one,
    newest first, by their numbers, with no number twice.
    """

    def __init__(self, capacity: int = 10_000, owner: int = 0) -> None:
        self.capacity = capacity
        self.owner = owner
        self._ring: deque[tuple[int, ResponseRecord]] = deque()
        self._by_id: dict[str, ResponseRecord] = {}
        self.total = 0  # records ever stored, the evicted ones included
        self._last = 0  # the last sequence number given

    def on_response(self, record: ResponseRecord) -> None:
        if len(self._ring) >= self.capacity:
            _, old = self._ring.popleft()
            for key in (old.request_id, old.upstream_request_id):
                if key is not None and self._by_id.get(key) is old:
                    del self._by_id[key]
        self.total += 1
        self._last = seq = max(self._last + OWNER_SPAN, time.time_ns() // 1000 * OWNER_SPAN + self.owner)
        self._ring.append((seq, record))
        self._by_id[record.request_id] = record
        if record.upstream_request_id is not None:
            self._by_id.setdefault(record.upstream_request_id, record)

    def __len__(self) -> int:
        return len(self._ring)

    def get(self, request_id: str) -> ResponseRecord | None:
        """A record by the proxy's request id, or by the upstream's own where it sent another."""
        return self._by_id.get(request_id)

    def newest_first(self) -> Iterator[ResponseRecord]:
        return (record for _, record in reversed(self._ring))

    def page(self, query: RecordQuery) -> Page:
        """The newest matching records older than the query's cursor."""
        return page_of(self.snapshot(), query)

    def snapshot(self) -> list[tuple[int, ResponseRecord]]:
        """The ring as it is now (a copy of references: microseconds for 10,000), to read in a thread
        while records keep arriving."""
        return list(self._ring)


def page_of(ring: Sequence[tuple[int, ResponseRecord]], query: RecordQuery) -> Page:
    """The newest records of `ring` (sequence numbers ascending) that match, older than the cursor."""
    found: list[ResponseRecord] = []
    last_seq: int | None = None
    for seq, record in matching(ring, query):
        if len(found) == query.limit:
            return Page(found, last_seq)
        found.append(record)
        last_seq = seq
    return Page(found, None)


def matching(ring: Sequence[tuple[int, ResponseRecord]], query: RecordQuery) -> Iterator[tuple[int, ResponseRecord]]:
    """The records of `ring` (sequence numbers ascending) that match, newest first, older than the cursor."""
    end = len(ring)
    if query.cursor is not None:
        end = bisect_left(ring, query.cursor, key=lambda entry: entry[0])
    for index in range(end - 1, -1, -1):
        entry = ring[index]
        if query.matches(entry[1]):
            yield entry
