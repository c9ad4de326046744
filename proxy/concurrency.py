"""In-flight tracking: how many generations ran beside each one, at its start, peak and on average.

The time-weighted mean uses one running integral of the in-flight count over time, so each
admission and release costs O(1) for the mean; peaks are pushed to the requests in flight.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Slot:
    """One admitted request's view of the concurrency around it."""

    __slots__ = ("at_start", "integral_start", "peak", "started")

    def __init__(self, at_start: int, started: float, integral_start: float) -> None:
        self.at_start = at_start
        self.peak = at_start
        self.started = started
        self.integral_start = integral_start


class InFlightTracker:
    """Counts requests in flight (the admitted one included) and their time-weighted mean."""

    __slots__ = ("_active", "_clock", "_integral", "_last_change", "in_flight")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._active: set[Slot] = set()
        self.in_flight = 0
        self._integral = 0.0  # the integral of in_flight over time, up to _last_change
        self._last_change = clock()

    def _advance(self, now: float) -> None:
        self._integral += self.in_flight * (now - self._last_change)
        self._last_change = now

    def admit(self) -> Slot:
        now = self._clock()
        self._advance(now)
        self.in_flight += 1
        count = self.in_flight
        for other in self._active:
            if count > other.peak:
                other.peak = count
        slot = Slot(count, now, self._integral)
        self._active.add(slot)
        return slot

    def release(self, slot: Slot) -> tuple[int, float]:
        """End a request's life; returns its (peak, time-weighted mean) concurrency."""
        if slot not in self._active:
            return slot.peak, float(slot.at_start)
        now = self._clock()
        self._advance(now)
        self._active.discard(slot)
        self.in_flight -= 1
        elapsed = now - slot.started
        mean = (self._integral - slot.integral_start) / elapsed if elapsed > 0 else float(slot.at_start)
        return slot.peak, mean


CONCURRENCY_BUCKETS = ("1", "2", "4", "8", "16", "32", "64", "128+")


def concurrency_bucket(value: int) -> str:
    """The smallest power of two >= value, as a label: `1`, `2`, `4`, ... `64`, then `128+`."""
    if value <= 1:
        return "1"
    if value > 64:
        return "128+"
    return str(1 << (value - 1).bit_length())
