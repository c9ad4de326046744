"""Where an exchange's record goes once the relay is done with it: the relay makes one call when an
exchange begins (`started`) and one when it ends (`ended`); everything after is the diagnosis's.

At the end the record is classified with what the server says of itself then (`Recorder.finish`),
the server's identity hears of the model it named, and the record goes on: first to the server's own
span of the request where the server sends them (`TraceJoin`, `--server-traces`), then to the
server's tokenizer when only it can decide a length stop (`ServerCheck.finished`), then to the
delivery.
A streamed answer holding little waits for the delivery's batch before it is classified
(`Delivery.later`), and is made in steps, the relay's reads between them: its inputs are fixed
when the exchange ends, so the record is the one it would have been at once. The sweep reads each
of its responses through the same `Recorder.finish` and `Recorder.settle_length` (`settle_now`), so
a sweep's record is the proxy's.
"""

from __future__ import annotations

from collections.abc import Iterator

from proxy.diagnosis.delivery import Delivery
from proxy.diagnosis.recorder import Recorder
from proxy.diagnosis.server_check import ServerCheck
from proxy.diagnosis.server_traces import TraceJoin
from proxy.record import ResponseRecord
from proxy.servers.base import UNKNOWN_SERVER, ServerIdentity, TokenizerQuery

# A finished exchange waits for its batch only while its recorder holds at most this (its request
# body and unparsed reads): with `delivery.MAX_WAITING`, what the waiting finishes hold is bounded.
DEFERRED_MAX_BYTES = 64 * 1024


class Finisher:
    """The diagnosis's side of every relayed exchange: its record's start and its end."""

    def __init__(self, delivery: Delivery, check: ServerCheck | None = None, traces: TraceJoin | None = None) -> None:
        self.delivery = delivery
        self.check = check  # what only the server can still say (None: it is asked nothing)
        self.traces = traces  # the server's own spans, joined first where it sends them (--server-traces)

    def started(self, record: ResponseRecord) -> None:
        """The request was admitted and its body read: the record names what it asks for."""
        self.delivery.response_started(record)

    def ended(self, recorder: Recorder, authorization: str | None) -> None:
        """The exchange is over (the relay wrote its last byte, or gave up): the record is made and
        handed on. `authorization`: the client's own, for the server's tokenizer, where it is asked."""
        identity = self.check.identity if self.check is not None else UNKNOWN_SERVER  # (as the exchange ended)
        steps = self._finish(recorder, identity, authorization)  # (a generator: nothing runs yet)
        if recorder.tally.streaming and recorder.held_bytes <= DEFERRED_MAX_BYTES:
            self.delivery.later(steps)
        else:
            self.delivery.now(steps)  # (a failure of the record path never reaches the client's connection)

    def _finish(self, recorder: Recorder, identity: ServerIdentity, authorization: str | None) -> Iterator[None]:
        """The record made in steps (`Recorder.finish_steps`), then handed on."""
        yield from recorder.finish_steps(server=identity)
        record = recorder.record
        if self.check is not None:
            self.check.saw_model(record.model)
        if self.traces is not None:
            delivered = recorder.tally.tokens if recorder.tally.streaming else None
            self.traces.finished(record, recorder.tokenizer_query(), authorization, delivered)
        else:
            self.checked(record, recorder.tokenizer_query(), authorization)

    def checked(self, record: ResponseRecord, query: TokenizerQuery | None, authorization: str | None) -> None:
        """A record past the server's spans: to the tokenizer where it still needs it, then delivered."""
        if self.check is None:
            self.delivery.response_finished(record)
            return
        self.check.finished(record, query, authorization)
