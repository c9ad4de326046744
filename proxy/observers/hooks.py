"""The hooks through which finished records reach the observers, declared once.

The forwarding path knows nothing of Prometheus, NVML, logs or history: the diagnosis's Delivery
calls these hooks on the observers that `serve.process.ServingProcess.open` declares in one list,
enrichers first. An observer reads a record and never writes it; an enricher returns what it knows
of the response's time, which the diagnosis writes into the record before the observers see it.

- `on_response_start(record)`: the request was admitted and its body read, before it goes
  upstream; the record holds its identity and what the request asks (the id, the path, the
  concurrency at admission, the model, the budget). Most observers need only the end: subclass
  `Observer` and the start costs nothing.
- `on_response(record)`: the response ended and was classified, what the enrichers know in it.
- `during(record)`: what an enricher knows of the response that the wire did not say.
"""

from __future__ import annotations

from typing import Protocol

from proxy.record import ResponseRecord, ServerDuring


class Observer(Protocol):
    """One job with each finished record (metrics, the log line, the store, history, spans)."""

    def on_response_start(self, record: ResponseRecord) -> None:
        """The request was admitted and read (no-op unless an observer needs it)."""
        return None

    def on_response(self, record: ResponseRecord) -> None:
        """The response ended and was classified."""
        ...


class Enricher(Protocol):
    """Knows what the GPU and the server were doing while a response ran."""

    def during(self, record: ResponseRecord) -> ServerDuring | None:
        """What was so during the response's window (None: no sample counts for it)."""
        ...


def watches_starts(observer: Observer) -> bool:
    """The observer has a start hook of its own (the default does nothing, and is not called)."""
    return type(observer).on_response_start is not Observer.on_response_start
