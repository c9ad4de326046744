"""What the processes of `--workers N` share in memory: every layout in one place.

Each worker maps the same pages (spawned processes get them pickled at their start); the
supervisor reads them and, when a worker dies, takes its share out at once. Every count is
per owner (slot 0 a single process's or the supervisor's, 1 + i worker i's: `proxy.processes.OWNERS`),
so that what a dead worker held is known exactly and given back without its help. Locks are
fcntl(2) record locks the kernel drops when their holder dies (`proxy.processes.ProcessLock`).

- the in-flight counts (`proxy.relay.in_flight`): the integral of the count over time, the time it
  last changed, the admissions; each owner's requests in flight; a ring of the count each admission
  saw (for every request's peak);
- the bytes held for parsing (`proxy.wire.parse_bytes`): each owner's bytes, the refusals;
- the tokenizer calls' gate (`proxy.diagnosis.tokenizer_queue.CallGate`): each owner's calls in
  flight, and the token bucket (allowance, when it was last filled);
- the ledger: each worker's records on their way, written by that worker alone (`Ledger`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from proxy.processes import OWNERS, ProcessLock
from proxy.record import ResponseRecord
from proxy.relay.in_flight import RING

# The ledger's slots of one owner.
OPEN = 0  # exchanges begun whose record has not gone through its delivery yet
DELIVERED = 1  # records delivered to this worker's observers, since it started
HANDED = 2  # records handed to its history's writer
KEPT = 3  # of those, written or counted as dropped by the writer (its thread writes this slot alone)
LEDGER_SLOTS = 4


class SharedCounts:
    """The in-flight counts (the fields of `proxy.relay.in_flight.LocalCounts`) in shared memory."""

    def __init__(self, context: Any) -> None:
        self.values: Any = context.RawArray("d", [0.0, time.monotonic(), 0.0])
        self.shares: Any = context.RawArray("i", OWNERS)
        self.ring: Any = context.RawArray("i", RING)
        self.lock: Any = ProcessLock()


@dataclass(frozen=True)
class SharedState:
    """All of it, made once by the supervisor and pickled to each worker it starts."""

    counts: SharedCounts
    parse_bytes: tuple[Any, Any, Any]  # shares, refusals, lock
    gate: tuple[Any, Any, Any]  # calls in flight, bucket, lock
    ledger: Any  # RawArray("q", OWNERS * LEDGER_SLOTS)

    @classmethod
    def allocate(cls, context: Any) -> SharedState:
        return cls(SharedCounts(context),
                   (context.RawArray("q", OWNERS), context.RawArray("q", 1), ProcessLock()),
                   (context.RawArray("q", OWNERS), context.RawArray("d", [1.0, time.monotonic()]), ProcessLock()),
                   context.RawArray("q", OWNERS * LEDGER_SLOTS))

    def remove(self) -> None:
        """The locks' files (the supervisor, at the end)."""
        for lock in (self.counts.lock, self.parse_bytes[2], self.gate[2]):
            lock.remove()


class Ledger:
    """One owner's slots of the ledger. The worker writes them (as the last observer of its
    delivery, and from its history's writer); when it dies, the supervisor reads what it took with it."""

    __slots__ = ("_base", "_slots")

    def __init__(self, slots: Any, owner: int) -> None:
        self._slots = slots
        self._base = owner * LEDGER_SLOTS

    def reset(self) -> None:
        for slot in range(LEDGER_SLOTS):
            self._slots[self._base + slot] = 0

    def __getitem__(self, slot: int) -> int:
        return int(self._slots[self._base + slot])

    def add(self, slot: int, count: int = 1) -> None:
        self._slots[self._base + slot] += count

    def lost(self, history: bool) -> int:
        """The records this owner took with it: begun and never delivered, and delivered to the
        history's writer but never written (a dead worker's buffer)."""
        unkept = max(0, self[HANDED] - self[KEPT]) if history else 0
        return max(0, self[OPEN]) + unkept


class LedgerObserver:
    """The last observer of a worker's delivery: counts each exchange begun, and each record delivered."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger

    def on_response_start(self, record: ResponseRecord) -> None:
        self._ledger.add(OPEN)

    def on_response(self, record: ResponseRecord) -> None:
        self._ledger.add(OPEN, -1)
        self._ledger.add(DELIVERED)
