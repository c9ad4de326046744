"""A finished record's way out: the enrichers' facts written in, then each observer called, in
the order of the chain. The diagnosis is the record's one writer, so the facts and the notes of
observers that failed are written here. An observer or enricher that raises never disturbs the
traffic, nor the observers after it: its failure becomes a note in `observer_errors`.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterable

import orjson
import structlog

from proxy.observers.hooks import Enricher, Observer, watches_starts
from proxy.record import SERVER_FACTS, TEXT_FIELDS, ResponseRecord, ServerDuring, compact_once, utf8_text

_log = structlog.get_logger("llm_diag_proxy.observers")
MAX_NOTED_ERRORS = 8
_text_values = operator.attrgetter(*TEXT_FIELDS)


class Delivery:
    """Hands records to a chain: enrichers, then observers, each in its order."""

    __slots__ = ("_enrichers", "_finishes", "_starts")

    def __init__(self, observers: Iterable[Observer] = (), enrichers: Iterable[Enricher] = ()) -> None:
        chain = list(observers)
        self._enrichers = [(type(e).__name__, e) for e in enrichers]
        self._starts = [(type(o).__name__, o) for o in chain if watches_starts(o)]
        self._finishes = [(type(o).__name__, o) for o in chain]

    def add(self, observer: Observer) -> None:
        """One more observer, last in the chain."""
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
                facts = enricher.facts_for(record)
            except Exception as exc:
                note_failure(record, name, exc)
                continue
            if facts:
                write_facts(record, facts)
        make_writable(record)  # a client's lone surrogate must not break the JSON, labels and rows below
        compact_once.delivering(record)  # its fields are final now: one compact dict for all observers
        try:
            for name, observer in self._finishes:
                try:
                    observer.on_response(record)
                except Exception as exc:
                    note_failure(record, name, exc)
        finally:
            compact_once.delivering(None)


def write_facts(record: ResponseRecord, facts: ServerDuring) -> None:
    """An enricher's facts into the record's fields of the same names (None leaves a field as it is)."""
    for name, value in facts.items():
        if value is not None and name in SERVER_FACTS:
            setattr(record, name, value)


def note_failure(record: ResponseRecord, name: str, exc: Exception) -> None:
    """An observer or enricher failed on this record: the record says so (bounded), and one log line."""
    if len(record.observer_errors) < MAX_NOTED_ERRORS:
        record.observer_errors.append(f"{name}: {type(exc).__name__}: {exc}"[:300])
    # The log itself may be what failed (a closed or broken stdout): the record says it then.
    with contextlib.suppress(OSError, ValueError):
        _log.warning("observer_failed", observer=name, error=repr(exc)[:300], request_id=record.request_id)


def make_writable(record: ResponseRecord) -> None:
    """Every text field of a finished record writable in UTF-8, so that JSON, a metric label, a log
    line or a database can take it: one lone surrogate would otherwise break each of them, and the
    history's writer, `/metrics` and the record's page with it. The usual record is looked at in
    two C calls: orjson refuses text that UTF-8 cannot hold."""
    values = _text_values(record)
    try:
        orjson.dumps(values)
        return
    except TypeError:
        pass
    for name, value in zip(TEXT_FIELDS, values, strict=True):
        if value:
            fixed = utf8_text(value)
            if fixed is not value:
                setattr(record, name, fixed)
