"""The hooks through which the forwarding path hands records to everything else.

The forwarding path knows nothing of Prometheus, NVML or logs: it calls these hooks, and
each observer does one job. An observer that raises never disturbs the traffic; its
failure is written into the record's `observer_errors`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import structlog

from proxy.record import ResponseRecord

_log = structlog.get_logger("llm_diag_proxy.observers")


class Observer(Protocol):
    """Receives a record when its response starts and when it has ended."""

    def on_response_start(self, record: ResponseRecord) -> None:
        """Called once the request is admitted; the record holds request-side fields only."""

    def on_response(self, record: ResponseRecord) -> None:
        """Called once per response, after classification; enrichers first, exporters last."""


class ObserverChain:
    """Calls observers in order and turns each one's failure into a note on the record."""

    __slots__ = ("_observers",)

    def __init__(self, observers: Iterable[Observer] = ()) -> None:
        self._observers: list[Observer] = list(observers)

    def add(self, observer: Observer) -> None:
        self._observers.append(observer)

    def response_started(self, record: ResponseRecord) -> None:
        for observer in self._observers:
            try:
                observer.on_response_start(record)
            except Exception as exc:  # an observer must never break forwarding
                self._note(record, observer, exc)

    def response_finished(self, record: ResponseRecord) -> None:
        for observer in self._observers:
            try:
                observer.on_response(record)
            except Exception as exc:
                self._note(record, observer, exc)

    @staticmethod
    def _note(record: ResponseRecord, observer: Observer, exc: Exception) -> None:
        name = type(observer).__name__
        if len(record.observer_errors) < 8:
            record.observer_errors.append(f"{name}: {type(exc).__name__}: {exc}"[:300])
        _log.warning("observer_failed", observer=name, error=repr(exc)[:300], request_id=record.request_id)
