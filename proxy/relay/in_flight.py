"""In-flight tracking: how many generations ran beside each one, at its start, peak and on average.

The time-weighted mean uses one running integral of the in-flight count over time, so each
admission and release costs O(1) for the mean. The peak of a request is the highest count any
admission during its life reached: every admission writes its count into a ring, and a release
takes the maximum of the ring's entries since its own admission (one C-level `max` over a slice).

The state lives either in this process or, with `--workers N`, in shared memory that every
worker process updates under one lock, so the counts are those of the whole proxy, not of one
worker (`proxy.serve.shared.SharedState`). The in-flight count is the sum of each process's share, so that a worker
that dies takes its requests out with it (`InFlightTracker.forget`).
"""

from __future__ import annotations

import contextlib
import time
from array import array
from collections.abc import Callable
from typing import Any

from proxy.processes import OWNERS

RING = 1 << 16  # admissions remembered for the peak; a request that outlives more sees the last RING
_INTEGRAL, _LAST_CHANGE, _ADMISSIONS = range(3)


class Slot:
    """One admitted request's view of the concurrency around it."""

    __slots__ = ("admission", "at_start", "integral_start", "peak", "started")

    def __init__(self, at_start: int, started: float, integral_start: float, admission: int) -> None:
        self.at_start = at_start
        self.peak = at_start
        self.started = started
        self.integral_start = integral_start
        self.admission = admission  # its number among all admissions


class LocalCounts:
    """The counts of one process: plain memory, no lock. (With `--workers N` the same fields live in
    shared memory under a lock the kernel drops when its holder dies: `proxy.serve.shared`.)"""

    def __init__(self) -> None:
        self.values: Any = array("d", [0.0, time.monotonic(), 0.0])
        self.shares: Any = array("i", bytes(4 * OWNERS))
        self.ring: Any = array("i", bytes(4 * RING))
        self.lock: Any = contextlib.nullcontext()


class InFlightTracker:
    """Counts requests in flight (the admitted one included), their peak and time-weighted mean.

    `owner` is this process's slot among the processes that share the counts (0 alone)."""

    __slots__ = ("_active", "_clock", "_counts", "_owner", "_ring", "_shares", "_values")

    def __init__(self, clock: Callable[[], float] = time.monotonic, counts: Any = None,
                 owner: int = 0) -> None:
        self._clock = clock
        self._counts = counts if counts is not None else LocalCounts()
        self._values = self._counts.values
        self._shares = memoryview(self._counts.shares).cast("B").cast("i")
        self._ring = memoryview(self._counts.ring).cast("B").cast("i")
        self._owner = owner
        if clock is not time.monotonic:  # a test's clock: start the integral at its zero
            self._values[_LAST_CHANGE] = clock()
        self._active: set[Slot] = set()  # this process's slots

    @property
    def in_flight(self) -> int:
        return sum(self._shares)

    def _advance(self, now: float, in_flight: int) -> None:
        values = self._values
        values[_INTEGRAL] += in_flight * (now - values[_LAST_CHANGE])
        values[_LAST_CHANGE] = now

    def admit(self) -> Slot:
        values, shares = self._values, self._shares
        with self._counts.lock:
            now = self._clock()
            before = sum(shares)
            self._advance(now, before)
            shares[self._owner] += 1
            count = before + 1
            admission = int(values[_ADMISSIONS]) + 1
            values[_ADMISSIONS] = admission
            self._ring[admission % RING] = count
            integral = values[_INTEGRAL]
        slot = Slot(count, now, integral, admission)
        self._active.add(slot)
        return slot

    def release(self, slot: Slot) -> tuple[int, float]:
        """End a request's life; returns its (peak, time-weighted mean) concurrency."""
        if slot not in self._active:
            return slot.peak, float(slot.at_start)
        values, shares = self._values, self._shares
        with self._counts.lock:
            now = self._clock()
            self._advance(now, sum(shares))
            shares[self._owner] = max(0, shares[self._owner] - 1)
            integral = values[_INTEGRAL]
            last = int(values[_ADMISSIONS])
            slot.peak = max(slot.at_start, self._highest_since(slot.admission, last))
        self._active.discard(slot)
        elapsed = now - slot.started
        mean = (integral - slot.integral_start) / elapsed if elapsed > 0 else float(slot.at_start)
        return slot.peak, mean

    def forget(self, owner: int) -> int:
        """Take a dead process's requests out of the count (the supervisor, when a worker dies);
        returns how many it had in flight."""
        with self._counts.lock:
            gone = self._shares[owner]
            if gone:
                self._advance(self._clock(), sum(self._shares))
                self._shares[owner] = 0
        return int(gone)

    def _highest_since(self, admission: int, last: int) -> int:
        """The highest count written by the admissions after `admission`, up to `last`."""
        if last <= admission:
            return 0
        first = max(admission + 1, last - RING + 1)
        start, end = first % RING, last % RING
        ring = self._ring
        if start <= end:
            return max(ring[start:end + 1])
        return max(max(ring[start:]), max(ring[:end + 1]))
