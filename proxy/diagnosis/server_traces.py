"""The server's own account of each request, joined to what the wire carried (`serve --server-traces`).

A server that exports its request spans to the proxy (`proxy.servers.traces`) says, per request, the
tokens it generated and counted in the prompt, how long the request queued, prefilled and decoded,
and when it finished. Joined by the request id the proxy sent upstream (else by the trace id), a
span decides what the wire alone leaves to inference:

- the tokens: the server's count (`tokens_source`, `prompt_tokens_source`: `server_trace`) where the
  wire carried no usage;
- a length stop's cause: the server's generated tokens at the requested budget is the budget, below
  it the server's own limit (`length_cause_source: server_trace`); the server's tokenizer is then not
  asked;
- the queue, prefill and decode times;
- **delivery**: the server finished an answer whose stream broke before its end: the cut is between
  the server's engine and the proxy (`undelivered`, cause `undelivered`);
- **after the client left**: a span of a request whose client left says the server ran it to its
  end, and for how long after (`server_after_disconnect_s`, `server_aborted: false`).

A record waits for its span only while the server is known to send them (a span arrived within
`expect_s`), at most `wait_s` after its answer ended; then it goes on to the tokenizer's check (where
it needs one) and the observers, once, with its final cause. Everything held is bounded: the records
waiting, the request bodies they keep for the tokenizer, the spans waiting for their record, and the
keys remembered to count a span that came too late.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from proxy.diagnosis.recorder import server_queue
from proxy.record import COMPLETE_STOP_REASONS, ResponseRecord
from proxy.servers.base import TokenizerQuery
from proxy.servers.traces import ServerSpan

# Where the wire broke without the server's end: the ends a span that finished can show cut in transit.
_BROKEN_ENDS = frozenset({"upstream_disconnect", "unknown"})


@dataclass(frozen=True, slots=True)
class TraceLimits:
    wait_s: float = 10.0  # a record waits this long after its end for its span (vLLM batches every 5 s)
    expect_s: float = 600.0  # records wait only while a span came within this
    span_hold_s: float = 60.0  # a span waits this long for its record
    max_waiting: int = 4096  # records waiting, for the whole process
    max_query_bytes: int = 32 * 1024 * 1024  # request bodies they keep for the tokenizer
    max_spans: int = 8192  # spans waiting for their record
    max_remembered: int = 8192  # keys of records handed on without a span, to tell a late span

    def share(self, workers: int) -> TraceLimits:
        share = max(1, workers)
        return TraceLimits(self.wait_s, self.expect_s, self.span_hold_s, max(1, self.max_waiting // share),
                           max(1, self.max_query_bytes // share), max(1, self.max_spans // share),
                           max(1, self.max_remembered // share))


DEFAULT_LIMITS = TraceLimits()
Next = Callable[[ResponseRecord, "TokenizerQuery | None", "str | None"], None]


@dataclass(slots=True)
class _Waiting:
    record: ResponseRecord
    query: TokenizerQuery | None
    authorization: str | None
    delivered: int | None
    keys: tuple[str, ...]
    timer: asyncio.TimerHandle | None = None


def record_keys(record: ResponseRecord) -> tuple[str, ...]:
    return tuple(key for key in ("id:" + record.request_id,
                                 record.trace_id and "trace:" + record.trace_id) if key)


class TraceJoin:
    """Records and the server's spans, each waiting a bounded time for the other."""

    def __init__(self, after: Next, limits: TraceLimits = DEFAULT_LIMITS,
                 on_span: Callable[[str, int], None] = lambda result, count: None,
                 clock: Callable[[], float] = time.monotonic, count_unmatched: bool = True) -> None:
        self._after = after  # where a record goes next: the tokenizer's check, else the delivery
        self.limits = limits
        self._on_span = on_span
        self._clock = clock
        self._count_unmatched = count_unmatched
        self._waiting: dict[str, _Waiting] = {}  # by each of its keys
        self._count = 0
        self._query_bytes = 0
        self._spans: OrderedDict[str, tuple[ServerSpan, float]] = OrderedDict()
        self._handed: OrderedDict[str, None] = OrderedDict()  # keys of records that went on without one
        self._last_span: float | None = None
        self._closed = False

    @property
    def expecting(self) -> bool:
        """The server sends its spans: one arrived within `expect_s`."""
        return self._last_span is not None and self._clock() - self._last_span <= self.limits.expect_s

    @property
    def waiting(self) -> int:
        return self._count

    def finished(self, record: ResponseRecord, query: TokenizerQuery | None, authorization: str | None,
                 delivered: int | None) -> None:
        """A finished record: joined to its span now, or held for it, or handed on at once.
        `delivered`: the pieces of output its stream carried (None: not a stream)."""
        keys = record_keys(record)
        for key in keys:
            found = self._spans.pop(key, None)
            if found is not None:
                for other in found[0].keys:
                    self._spans.pop(other, None)
                self._on_span("joined", 1)
                query = apply_span(record, found[0], query, delivered)
                self._after(record, query, authorization)
                return
        query_bytes = len(query.body) if query is not None else 0
        if (self._closed or not self.expecting or record.route == "other" or self._count >= self.limits.max_waiting
                or self._query_bytes + query_bytes > self.limits.max_query_bytes):
            self._after(record, query, authorization)
            return
        waiting = _Waiting(record, query, authorization, delivered, keys)
        for key in keys:
            self._waiting[key] = waiting
        self._count += 1
        self._query_bytes += query_bytes
        waiting.timer = asyncio.get_running_loop().call_later(self.limits.wait_s, self._missing, waiting)

    def receive(self, spans: list[ServerSpan]) -> None:
        """Spans from the server: each joins its waiting record, or waits for it."""
        now = self._clock()
        if spans:
            self._last_span = now
        self._expire(now)
        for span in spans:
            waiting = next((w for w in (self._waiting.get(key) for key in span.keys) if w is not None), None)
            if waiting is not None:
                self._release(waiting)
                self._on_span("joined", 1)
                query = apply_span(waiting.record, span, waiting.query, waiting.delivered)
                self._after(waiting.record, query, waiting.authorization)
                continue
            if any(key in self._handed for key in span.keys):
                self._on_span("late", 1)  # its record went on without it: nothing is updated
                continue
            if len(self._spans) >= self.limits.max_spans:
                _, (oldest, _) = self._spans.popitem(last=False)
                for other in oldest.keys:
                    self._spans.pop(other, None)
                self._unmatched()
            for key in span.keys:
                self._spans[key] = (span, now)

    def _expire(self, now: float) -> None:
        while self._spans:
            span, arrived = next(iter(self._spans.values()))
            if now - arrived <= self.limits.span_hold_s:
                break
            for other in span.keys:
                self._spans.pop(other, None)
            self._unmatched()  # no record of the proxy's came for it

    def _unmatched(self) -> None:
        if self._count_unmatched:
            self._on_span("unmatched", 1)

    def _release(self, waiting: _Waiting) -> None:
        for key in waiting.keys:
            if self._waiting.get(key) is waiting:
                del self._waiting[key]
        if waiting.timer is not None:
            waiting.timer.cancel()
        self._count -= 1
        self._query_bytes -= len(waiting.query.body) if waiting.query is not None else 0

    def _missing(self, waiting: _Waiting) -> None:
        self._release(waiting)
        record = waiting.record
        record.server_trace = "missing"
        detail = f"no span from the server within {self.limits.wait_s:g} s of the answer's end"
        if record.client_disconnected:
            detail += " (vLLM sends none for a request it aborted when its client left)"
        record.server_trace_detail = detail
        for key in waiting.keys:
            self._handed[key] = None
        while len(self._handed) > self.limits.max_remembered:
            self._handed.popitem(last=False)
        self._after(record, waiting.query, waiting.authorization)

    def close(self) -> None:
        """Hand on every record still waiting, as it is."""
        self._closed = True
        for waiting in list({id(w): w for w in self._waiting.values()}.values()):
            self._release(waiting)
            self._after(waiting.record, waiting.query, waiting.authorization)


def apply_span(record: ResponseRecord, span: ServerSpan, query: TokenizerQuery | None,
               delivered: int | None) -> TokenizerQuery | None:
    """What the server's span says of a record; returns the tokenizer query still needed (None once
    the span decided the length stop)."""
    record.server_trace = "joined"
    generated = span.completion_tokens
    record.server_output_tokens = generated
    if generated is not None and record.tokens_source != "usage":
        record.output_tokens, record.tokens_source = generated, "server_trace"
    if span.prompt_tokens is not None and record.prompt_tokens_source != "usage":
        record.prompt_tokens, record.prompt_tokens_source = span.prompt_tokens, "server_trace"
    if span.queue_s is not None:
        server_queue(record, round(span.queue_s, 6), "server_trace")
    if span.prefill_s is not None or span.decode_s is not None:
        record.server_prefill_s, record.server_decode_s = span.prefill_s, span.decode_s
        record.server_times_source = "server_trace"
    query = _length_cause(record, span, query)
    _delivery(record, span, delivered)
    return query  # (made writable with every record on its way to the observers)


def _length_cause(record: ResponseRecord, span: ServerSpan, query: TokenizerQuery | None) -> TokenizerQuery | None:
    generated = span.completion_tokens
    if record.stop_reason != "length" or generated is None or (record.n or 1) > 1 or (span.n or 1) > 1:
        return query
    if record.length_cause not in (None, "unknown") and record.length_cause_source != "counted":
        return query  # already decided by what the wire or the server's finish said
    budget = record.requested_max_tokens if record.requested_max_tokens is not None else span.max_tokens
    if budget is None:
        record.length_cause = "server_limit"
        record.length_cause_detail = (f"the server generated {generated:,} tokens (its trace) and no budget was "
                                      "asked: its own limit (the context left) ended it")
    elif generated >= budget:
        record.length_cause = "requested_budget"
        record.length_cause_detail = f"the server generated {generated:,} tokens (its trace): the requested budget"
    else:
        record.length_cause = "server_limit"
        record.length_cause_detail = (f"the server generated {generated:,} tokens (its trace), below the requested "
                                      f"{budget:,}: its own limit ended it")
    record.length_cause_source = "server_trace"
    return None


def _delivery(record: ResponseRecord, span: ServerSpan, delivered: int | None) -> None:
    generated = span.completion_tokens
    if record.client_disconnected:
        left_at = record.started_at + record.duration_s
        after = span.end_unix_s - left_at
        record.server_after_disconnect_s = round(max(0.0, after), 3) if math.isfinite(after) else None
        record.server_aborted = False  # it finished the request and traced it: an abort is not traced
        return
    if record.stop_reason in _BROKEN_ENDS and record.status == 200:
        record.undelivered = True
        carried = f"{delivered:,} pieces of output" if delivered is not None else "part of the answer"
        said = f"{generated:,} tokens" if generated is not None else "its answer"
        record.undelivered_detail = (
            f"the server generated {said} and finished (its trace); the stream carried {carried} and broke "
            "before its end: the cut is between the server's engine and the proxy (its HTTP layer, or a "
            "gateway, load balancer or timeout on that path)")
    elif record.stop_reason in COMPLETE_STOP_REASONS or record.stop_reason == "length":
        record.undelivered = False
