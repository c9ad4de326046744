"""A bounded, time-ordered ring of samples, and the window queries a finished response asks of it.

Which samples count for a response that ran over [t0, t1] (unix seconds):

* every sample stamped inside [t0, t1], ends included;
* if none is inside (the response was shorter than the poll interval), the newest sample
  stamped before t0, but only if it is at most `max_age` seconds older than t0: an older
  one describes another moment and is not used;
* never a sample after t1: the record is exported as soon as the response ends, before
  the next poll could have happened.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


def capacity_for(interval_s: float, horizon_s: float = 3600.0, floor: int = 64, cap: int = 36_000) -> int:
    """How many samples hold `horizon_s` of history at one per `interval_s`, within [floor, cap]."""
    if interval_s <= 0:
        return floor
    return max(floor, min(cap, int(horizon_s / interval_s) + 1))


def window_bounds(times: Sequence[float], t0: float, t1: float, max_age: float) -> tuple[int, int]:
    """Index range [lo, hi) of the samples that count for [t0, t1] (see the module docstring).

    `times` is sorted ascending. An empty range (lo == hi) means no sample counts.
    """
    if t1 < t0:
        t1 = t0
    lo = bisect_left(times, t0)
    hi = bisect_right(times, t1)
    if lo < hi:
        return lo, hi
    before = lo - 1  # the newest sample stamped before t0
    if before >= 0 and t0 - times[before] <= max_age:
        return before, before + 1
    return lo, lo


def last_at_or_before(times: Sequence[float], t: float) -> int | None:
    """Index of the newest sample stamped at or before `t`, or None."""
    index = bisect_right(times, t) - 1
    return index if index >= 0 else None


def max_of(values: Iterable[float | None]) -> float | None:
    """The largest known value, or None when none is known."""
    known = [v for v in values if v is not None]
    return max(known) if known else None


def min_of(values: Iterable[float | None]) -> float | None:
    """The smallest known value, or None when none is known."""
    known = [v for v in values if v is not None]
    return min(known) if known else None


def counter_increase(values: Iterable[float | None]) -> float | None:
    """How much a cumulative counter rose across consecutive readings, counting resets.

    A drop means the server restarted its counter (as Prometheus' `increase()` assumes):
    the new value is what was counted since the reset. Unknown readings are skipped;
    fewer than two known readings give None (nothing was observed to change).
    """
    total = 0.0
    previous: float | None = None
    seen = 0
    for value in values:
        if value is None:
            continue
        seen += 1
        if previous is not None:
            total += value - previous if value >= previous else value
        previous = value
    return total if seen >= 2 else None


class SampleRing(Generic[T]):
    """The last `capacity` samples with their unix-time stamps, oldest first.

    Appends are amortised O(1); queries bisect the stamps. A stamp earlier than the
    newest one (the wall clock stepped back) is raised to it, so the ring stays sorted.
    """

    __slots__ = ("_items", "_times", "capacity", "on_append")

    def __init__(self, capacity: int, on_append: Callable[[float, T], None] | None = None) -> None:
        """`on_append(t, item)`: told of each sample as it is kept (the supervisor of N workers
        passes each on to them)."""
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.on_append = on_append
        self._times: list[float] = []
        self._items: list[T] = []

    def __len__(self) -> int:
        return len(self._times) - self._trim_view()

    def append(self, t: float, item: T) -> None:
        if self._times and t < self._times[-1]:
            t = self._times[-1]
        self._times.append(t)
        self._items.append(item)
        if self.on_append is not None:
            self.on_append(t, item)
        if len(self._times) >= 2 * self.capacity:
            excess = len(self._times) - self.capacity
            del self._times[:excess]
            del self._items[:excess]

    def _trim_view(self) -> int:
        """Index of the oldest sample still inside the capacity (the list keeps up to 2x)."""
        return max(0, len(self._times) - self.capacity)

    def window(self, t0: float, t1: float, max_age: float) -> list[tuple[float, T]]:
        """The (stamp, sample) pairs that count for a response over [t0, t1]."""
        lo, hi = window_bounds(self._times, t0, t1, max_age)
        lo = max(lo, self._trim_view())
        return list(zip(self._times[lo:hi], self._items[lo:hi], strict=True))

    def span(self, first: int, last: int) -> list[tuple[float, T]]:
        """The (stamp, sample) pairs from index `first` to `last`, both included."""
        first = max(first, self._trim_view())
        return list(zip(self._times[first:last + 1], self._items[first:last + 1], strict=True))

    def index_at_or_before(self, t: float) -> int | None:
        index = last_at_or_before(self._times, t)
        if index is None or index < self._trim_view():
            return None
        return index

    def stamp(self, index: int) -> float:
        return self._times[index]

    def newest(self, count: int) -> list[tuple[float, T]]:
        """The newest `count` (stamp, sample) pairs, oldest first."""
        first = max(self._trim_view(), len(self._times) - count)
        return list(zip(self._times[first:], self._items[first:], strict=True))

    def latest(self) -> tuple[float, T] | None:
        if not self._times:
            return None
        return self._times[-1], self._items[-1]

    def values(self, pick: Callable[[T], float | None]) -> list[float | None]:
        """One picked field of every kept sample, oldest first (for tests and debugging)."""
        start = self._trim_view()
        return [pick(item) for item in self._items[start:]]
