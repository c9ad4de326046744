"""A finished record's way out: what the enrichers know of its time written in, then each observer
called, in order. The diagnosis is the record's one writer, so the enrichers' fields and the notes
of observers that failed are written here. An observer or enricher that raises never disturbs the
traffic, nor the observers after it: its failure becomes a note in `observer_errors`.

A live proxy hands its finished records to the observers in batches (`batch_s`): at one event per
write a server's answers end one at a time, a few milliseconds apart, and the observers' code
(metrics, the log line, the history's row) run once per record is out of the CPU's caches each
time; run back to back for a batch, the whole proxy spent 4-11 % less CPU per event (64 streams at
one event per write, `benchmarks/overhead.py`), and batches of tens of records rather than a few
about 5 % less again (`benchmarks/side_by_side.py`). A batch goes when its first record has waited
`batch_s`, or as soon as FULL_BATCH wait, whichever comes first. It is delivered in slices of at
most SLICE_S (and one item), the relay's reads between them: the loop is never held much longer than
the finishing of one record held it before. The record is final before it waits (enrichers'
facts, its text made writable); `flush()` delivers what waits at once, and whatever reads what the
observers keep (the admin listener, the shutdown) calls it first, so nothing that was answered is
missing from what is read. The wait is bounded in time and count.

The relay's finishing of a streamed answer (the last reads parsed, the record classified) can wait
with the batch too (`later`): its inputs are fixed when the exchange ends, so the record is the
one it would have been at once, and its code runs warm with the others. It is given as steps (a
generator: a few reads parsed, then the record filled), and each step and each record's observers
is one item of a slice: a turn holds the loop for about SLICE_S, not for a whole record's making
(at 64 paced streams a record's making took 0.5-0.7 ms live, in one piece; the first token of a
new request waited behind it).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from enum import Enum

import structlog

from proxy.diagnosis.writable import make_writable
from proxy.observers.hooks import Enricher, Observer, watches_starts
from proxy.record import DURING_FIELDS, CompactOnce, ResponseRecord, ServerDuring

_log = structlog.get_logger("llm_diag_proxy.observers")
MAX_NOTED_ERRORS = 8
FULL_BATCH = 64  # records waiting: their batch goes now, its time up or not (warm enough, and bounded)
MAX_WAITING = 256  # records waiting for a batch: past it, the oldest is delivered at once
SLICE_S = 0.0001  # a batch is delivered in slices of this long, the loop's other work between them
Steps = Iterator[None]  # a record's making: each step runs alone, the loop's other work may come between


class _Making(Enum):
    """Where the record of the finish that runs now goes."""

    NONE = "none"  # no finish runs: a finished record waits for its batch
    NEXT = "next"  # a step of a waiting finish runs: its record is the next item
    NOW = "now"  # a waiting finish runs whole (flushed, or the queue is full): its record is observed at once


class Delivery:
    """Hands records on: to the enrichers, then to the observers, each in its order."""

    __slots__ = ("_batch_s", "_enrichers", "_finishes", "_lost", "_making", "_starts", "_timer", "_waiting",
                 "compact")

    def __init__(self, observers: Iterable[Observer] = (), enrichers: Iterable[Enricher] = (), *,
                 batch_s: float = 0.0, on_lost: Callable[[], None] = lambda: None,
                 compact: CompactOnce | None = None) -> None:
        """`batch_s`: the longest a finished record waits for its batch (0: delivered at once);
        `on_lost`: a record could not be made at all (counted in llm_proxy_records_lost_total);
        `compact`: the one compact dict per delivered record, which the observers made with it share."""
        self._lost = LostRecords(on_lost)
        self.compact = compact if compact is not None else CompactOnce()
        observers = list(observers)
        self._enrichers = [(type(e).__name__, e) for e in enrichers]
        self._starts = [(type(o).__name__, o) for o in observers if watches_starts(o)]
        self._finishes = [(type(o).__name__, o) for o in observers]
        self._batch_s = batch_s
        self._waiting: deque[ResponseRecord | Steps] = deque()  # records, and work making them
        self._timer: asyncio.Handle | None = None
        self._making = _Making.NONE

    def add(self, observer: Observer) -> None:
        """One more observer, after the others."""
        name = type(observer).__name__
        if watches_starts(observer):
            self._starts.append((name, observer))
        self._finishes.append((name, observer))

    def response_started(self, record: ResponseRecord) -> None:
        for name, observer in self._starts:
            try:
                observer.on_response_start(record)
            except Exception as exc:  # an observer must never break forwarding
                note_failure(record, name, exc)

    def response_finished(self, record: ResponseRecord) -> None:
        for name, enricher in self._enrichers:
            try:
                during = enricher.during(record)
            except Exception as exc:
                note_failure(record, name, exc)
                continue
            if during:
                write_during(record, during)
        make_writable(record)  # a client's lone surrogate must not break the JSON, labels and rows below
        making = self._making
        if not self._batch_s or making is _Making.NOW:
            self._observe(record)
        elif making is _Making.NEXT:
            self._waiting.appendleft(record)  # (its place in the order is its finish's)
        else:
            self._wait(record)

    def later(self, finish: Steps) -> None:
        """`finish` (which ends in `response_finished`) run with the batch, a step per item, or
        now without one."""
        if self._batch_s:
            self._wait(finish)
            return
        self._run(finish)

    def now(self, finish: Steps) -> None:
        """`finish` run at once, its failure (a diagnosis bug) kept from the caller: the relay's
        handler and the client's connection never see it. The record is counted lost and said."""
        self._run(finish)

    def _wait(self, item: ResponseRecord | Steps) -> None:
        waiting = self._waiting
        waiting.append(item)
        if self._timer is None:
            try:
                self._timer = asyncio.get_running_loop().call_later(self._batch_s, self._turn)
            except RuntimeError:  # no loop runs (a tool's own use): nothing would deliver it later
                self.flush()
                return
        elif len(waiting) == FULL_BATCH:  # a full batch: it goes now, in its slices (a waiting record comes
            # in here one at a time; were a batch's slices already under way, its next one is only moved)
            self._timer.cancel()
            self._timer = asyncio.get_running_loop().call_soon(self._turn)
        while len(waiting) > MAX_WAITING:  # more finish than the turns deliver: the oldest goes now, whole
            self._whole(waiting.popleft())

    def flush(self) -> None:
        """Deliver everything waiting, now, in the order it finished."""
        self._deliver(None)

    def _turn(self) -> None:
        """The batch's time has come: a slice of it, then the loop's other work (the relay's reads),
        then the next slice."""
        self._timer = None
        self._deliver(time.monotonic() + SLICE_S)

    def _deliver(self, until: float | None) -> None:
        waiting = self._waiting
        while waiting:  # (a finish, or an observer, may add to it meanwhile: that goes too)
            self._step(waiting.popleft())
            if until is not None and time.monotonic() >= until:
                break
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if waiting:
            self._timer = asyncio.get_running_loop().call_soon(self._turn)

    def _step(self, item: ResponseRecord | Steps) -> None:
        """A record to the observers, or one step of a finish: what is left of it, or else its
        record, is the next item (the order of records is the order their exchanges ended)."""
        if isinstance(item, ResponseRecord):
            self._observe(item)
            return
        making, self._making = self._making, _Making.NEXT
        try:
            next(item)
        except StopIteration:
            return
        except Exception as exc:  # a diagnosis bug: that record is lost, counted and said, the rest go on
            self._lost.failed(exc)
            return
        finally:
            self._making = making
        self._waiting.appendleft(item)

    def _whole(self, item: ResponseRecord | Steps) -> None:
        """An item delivered whole: a record, or a finish's every step and then its record (one item
        out is one record delivered: the queue does not grow, nothing nests)."""
        if isinstance(item, ResponseRecord):
            self._observe(item)
            return
        making, self._making = self._making, _Making.NOW
        try:
            self._run(item)
        finally:
            self._making = making

    def _observe(self, record: ResponseRecord) -> None:
        compact = self.compact
        compact.delivering(record)  # its fields are final now: one compact dict for all observers
        try:
            for name, observer in self._finishes:
                try:
                    observer.on_response(record)
                except Exception as exc:
                    note_failure(record, name, exc)
        finally:
            compact.delivering(None)

    def _run(self, finish: Steps) -> None:
        try:
            for _ in finish:
                pass
        except Exception as exc:  # a diagnosis bug: that record is lost, counted and said, the rest go on
            self._lost.failed(exc)


def write_during(record: ResponseRecord, during: ServerDuring) -> None:
    """What an enricher knows of the response's time into the record's fields of the same names
    (None leaves a field as it is)."""
    for name, value in during.items():
        if value is not None and name in DURING_FIELDS:
            setattr(record, name, value)


def note_failure(record: ResponseRecord, name: str, exc: Exception) -> None:
    """An observer or enricher failed on this record: the record says so (bounded), and one log line."""
    if len(record.observer_errors) < MAX_NOTED_ERRORS:
        record.observer_errors.append(f"{name}: {type(exc).__name__}: {exc}"[:300])
    # The log itself may be what failed (a closed or broken stdout): the record says it then.
    with contextlib.suppress(OSError, ValueError):
        _log.warning("observer_failed", observer=name, error=repr(exc)[:300], request_id=record.request_id)


class LostRecords:
    """Records the proxy could not make or hand on (a bug, a channel gone): each counted (`on_lost`:
    llm_proxy_records_lost_total), and one log line for the first of each kind of failure, not one per
    record (a bug that fails every record must not flood the log)."""

    MAX_KINDS = 32

    def __init__(self, on_lost: Callable[[], None] = lambda: None) -> None:
        self._on_lost = on_lost
        self._said: set[str] = set()
        self.count = 0

    def failed(self, exc: BaseException, what: str = "record_failed") -> None:
        self.count += 1
        with contextlib.suppress(Exception):
            self._on_lost()
        kind = f"{what}:{type(exc).__name__}"
        if kind in self._said or len(self._said) >= self.MAX_KINDS:
            return
        self._said.add(kind)
        with contextlib.suppress(OSError, ValueError):
            _log.error(what, error=repr(exc)[:300], note="the record of this exchange is lost (counted in "
                       "llm_proxy_records_lost_total; later ones of this kind are counted, not logged); the "
                       "traffic was not affected")
