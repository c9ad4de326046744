"""The hooks through which the forwarding path hands records to everything else.

The forwarding path knows nothing of Prometheus, NVML, logs or history: it calls these hooks,
and each observer does one job. An observer implements only the hooks it needs; the chain
calls a hook only on the observers that have it. An observer that raises never disturbs the
traffic; its failure is written into the record's `observer_errors`.

The hooks:
- `on_response_start(record)`: the request was admitted, before its body is read; the record
  holds its identity only (the id, the method, the path, the concurrency at admission).
- `on_response(record)`: the response ended and was classified; enrichers run first, so what
  they add reaches the exporters after them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import structlog

from proxy.record import ResponseRecord

_log = structlog.get_logger("llm_diag_proxy.observers")

Hook = Callable[[ResponseRecord], None]
MAX_NOTED_ERRORS = 8


class ObserverChain:
    """Calls each hook on the observers that implement it, in order; failures become notes."""

    __slots__ = ("_finishes", "_starts")

    def __init__(self, observers: Iterable[object] = ()) -> None:
        self._starts: list[tuple[str, Hook]] = []
        self._finishes: list[tuple[str, Hook]] = []
        for observer in observers:
            self.add(observer)

    def add(self, observer: object) -> None:
        name = type(observer).__name__
        start = getattr(observer, "on_response_start", None)
        if callable(start):
            self._starts.append((name, start))
        finish = getattr(observer, "on_response", None)
        if callable(finish):
            self._finishes.append((name, finish))

    def response_started(self, record: ResponseRecord) -> None:
        for name, hook in self._starts:
            try:
                hook(record)
            except Exception as exc:  # an observer must never break forwarding
                self._note(record, name, exc)

    def response_finished(self, record: ResponseRecord) -> None:
        for name, hook in self._finishes:
            try:
                hook(record)
            except Exception as exc:
                self._note(record, name, exc)

    @staticmethod
    def _note(record: ResponseRecord, name: str, exc: Exception) -> None:
        if len(record.observer_errors) < MAX_NOTED_ERRORS:
            record.observer_errors.append(f"{name}: {type(exc).__name__}: {exc}"[:300])
        # The log itself may be what failed (a closed or broken stdout): the record says it then.
        with contextlib.suppress(OSError, ValueError):
            _log.warning("observer_failed", observer=name, error=repr(exc)[:300], request_id=record.request_id)
