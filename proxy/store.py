"""The record store: the newest records in a bounded ring, findable by request id."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from proxy.record import ResponseRecord


class RecordStore:
    """Keeps the last `capacity` records (an observer: it stores each finished record)."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._ring: deque[ResponseRecord] = deque()
        self._by_id: dict[str, ResponseRecord] = {}
        self.total = 0  # records ever stored, the evicted ones included

    def on_response(self, record: ResponseRecord) -> None:
        if len(self._ring) >= self.capacity:
            old = self._ring.popleft()
            if self._by_id.get(old.request_id) is old:
                del self._by_id[old.request_id]
        self._ring.append(record)
        self._by_id[record.request_id] = record
        self.total += 1

    def __len__(self) -> int:
        return len(self._ring)

    def get(self, request_id: str) -> ResponseRecord | None:
        return self._by_id.get(request_id)

    def newest_first(self) -> Iterator[ResponseRecord]:
        return reversed(self._ring)

    def query(self, *, stop_reason: str | None = None, model: str | None = None,
              limit: int = 100) -> list[ResponseRecord]:
        """Newest first, filtered by exact stop reason and model."""
        found: list[ResponseRecord] = []
        for record in reversed(self._ring):
            if stop_reason is not None and record.stop_reason != stop_reason:
                continue
            if model is not None and record.model != model:
                continue
            found.append(record)
            if len(found) >= limit:
                break
        return found
