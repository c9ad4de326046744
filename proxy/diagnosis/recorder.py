"""The per-exchange recorder: what one request and its response showed, turned into one record.

It is fed from outside and does no I/O: the request body, the response head, each chunk, and
how the exchange ended (the end of the body, a reset, a client gone, a connect failure, an
enforced deadline). `finish()` classifies and returns the `ResponseRecord`. The forwarding path
feeds it from the proxy's side and the sweep from the client's side, so both classify alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from proxy.diagnosis import usability
from proxy.diagnosis.classify import WireFacts, classify, refusal_counts
from proxy.diagnosis.prompt_rules import (
    PromptCount,
    context_of,
    length_cause_from_prompt,
    prompt_truncation,
    server_limit_detail,
)
from proxy.diagnosis.stream_tally import AnswerTexts, StreamTally
from proxy.diagnosis.writable import make_writable
from proxy.record import (
    MAX_IGNORED,
    DeadlineKind,
    RequestInfo,
    ResponseRecord,
    UpstreamErrorKind,
    utf8_text,
)
from proxy.servers.base import UNKNOWN_SERVER, ServerIdentity, TokenizerQuery
from proxy.wire.dialects import FALLBACK, route_of
from proxy.wire.dialects.base import Dialect
from proxy.wire.events import Usage
from proxy.wire.parse_bytes import UNLIMITED, ParseBytes
from proxy.wire.parsers import Read, load_json, parser_for

DeadlineHit = Literal["total", "idle"]
Routed = tuple[str, Dialect | None]  # a request's route, and the dialect it is read in (None: not read)
QUEUE_TIME_RESOLUTION = 9  # decimals: ns, as servers report durations; below is float noise


@dataclass(frozen=True, slots=True)
class ParseLimits:
    """How much of a response the recorder reads: the longest line, the largest JSON body."""

    max_line_bytes: int = 4 * 1024 * 1024
    body_cap_bytes: int = 32 * 1024 * 1024
    parse_bytes: ParseBytes = UNLIMITED  # shared by every exchange of a process
    fast_path: bool = True  # plain token events counted without decoding (identical records)


def read_request(dialect: Dialect, body: bytes | bytearray) -> RequestInfo:
    """What a generation request asks for; never raises (a body it cannot read is noted)."""
    info = RequestInfo()
    if not body:
        info.body_note = "empty body"
        return info
    try:
        obj = load_json(body)
    except ValueError:
        info.body_note = "request body is not JSON"
        return info
    if not isinstance(obj, dict):
        info.body_note = "request body is not a JSON object"
        return info
    info.body_parsed = True
    stream = obj.get("stream")
    info.stream = stream if isinstance(stream, bool) else dialect.streams_by_default
    try:
        dialect.read_request(obj, info)
    except Exception as exc:  # a field of an unexpected shape: noted, and the request goes on unchanged
        info.body_note = f"request field not understood: {type(exc).__name__}"
    return info


# A stream may carry output the proxy does not see as a piece (an EOS, a special token that shows no
# text) while its server counts it: this many counted tokens beyond none delivered prove nothing.
UNSEEN_TOKENS = 8


def usage_mismatch(usage: Usage | None, delivered: int | None) -> str | None:
    """The server's counts, where they cannot all be true: more reasoning than output (SGLang
    #39826), or output counted on a stream that delivered none of it (lmstudio-bug-tracker#2339;
    speculative decoding reporting the whole budget, ik_llama.cpp#2358, where the stream carried
    nothing). A stream that delivered pieces is not compared with a count: a piece may carry several
    tokens, so its count bounds the tokens from below only."""
    if usage is None or usage.completion_tokens is None:
        return None
    output, reasoning = usage.completion_tokens, usage.reasoning_tokens
    if reasoning is not None and reasoning > output:
        return f"reasoning_tokens {reasoning:,} exceed completion_tokens {output:,}"
    if delivered == 0 and output > UNSEEN_TOKENS:
        return f"completion_tokens {output:,}, while the stream delivered no output at all"
    return None


def server_queue(record: ResponseRecord, seconds: float, source: str) -> None:
    """The server's own queue time: `server_queue_s`, and `queue_time_s` unless the proxy's gate held
    the request (its wait there is the record's queue time then)."""
    record.server_queue_s = seconds
    if record.queue_time_source != "proxy":
        record.queue_time_s, record.queue_time_source = seconds, source


class Recorder:
    """One exchange: request, response head, chunks and its end in, one `ResponseRecord` out."""

    __slots__ = (
        "_client_left",
        "_connect_error",
        "_deadline_observed",
        "_dialect",
        "_ended_at",
        "_enforced",
        "_error_detail",
        "_info",
        "_limits",
        "_not_admitted",
        "_proxy_failed",
        "_request_body",
        "_reset",
        "_shutdown",
        "_started",
        "record",
        "tally",
    )

    def __init__(self, record: ResponseRecord, dialect: Dialect | None, started: float,
                 limits: ParseLimits = ParseLimits()) -> None:
        self.record = record
        self._dialect = dialect
        self._started = started  # monotonic; record.started_at is the same moment in unix time
        self._limits = limits
        self._info = RequestInfo()
        self._request_body: bytes | bytearray | None = None  # held for the server's tokenizer, never copied
        self.tally = StreamTally(None)
        self._connect_error: UpstreamErrorKind | None = None
        self._error_detail: str | None = None
        self._reset = False
        self._client_left = False
        self._not_admitted: str | None = None
        self._enforced: DeadlineKind = "none"
        self._deadline_observed: DeadlineKind = "none"
        self._shutdown = False
        self._proxy_failed: str | None = None
        self._ended_at: float | None = None

    @staticmethod
    def routed(path: str) -> Routed:
        """How a request to `path` is read: its route and dialect (what `start` finds from `path`)."""
        return route_of(path)

    @staticmethod
    def reads(routed: Routed) -> bool:
        """A request so routed is a generation in a dialect the recorder reads (`inference`)."""
        return routed[1] is not None

    @classmethod
    def start(cls, request_id: str, method: str, path: str, *, limits: ParseLimits = ParseLimits(),
              started: float | None = None, started_at: float | None = None, routed: Routed | None = None,
              instance: str | None = None, upstream: str | None = None, client: str | None = None) -> Recorder:
        """A recorder for a request to `path`, its dialect found by route (`routed`, when it was
        found already), sent by `client` and seen by the proxy `instance` on its way to `upstream`;
        it started at `started` (monotonic) and `started_at` (unix time), by default now."""
        route, dialect = route_of(path) if routed is None else routed
        record = ResponseRecord(request_id=request_id, method=method, path=path[:512], route=route,
                                dialect=dialect.name if dialect is not None else "none",
                                started_at=time.time() if started_at is None else started_at,
                                instance=instance, upstream=upstream, client=client)
        return cls(record, dialect, time.monotonic() if started is None else started, limits)

    @property
    def inference(self) -> bool:
        """The request is a generation in a dialect the proxy reads."""
        return self._dialect is not None

    def trace_context(self, traceparent: str | None) -> None:
        """The client's W3C `traceparent` (version 00): its trace and span ids go on the record,
        so the exported span joins the client's trace; anything malformed is ignored."""
        if traceparent is None or len(traceparent) != 55:
            return
        version, trace_id, span_id, flags = [*traceparent.split("-"), "", "", ""][:4]
        valid = (version == "00" and len(trace_id) == 32 and len(span_id) == 16 and len(flags) == 2
                 and all(c in "0123456789abcdef" for c in trace_id + span_id + flags)
                 and trace_id != "0" * 32 and span_id != "0" * 16)
        if valid:
            self.record.trace_id, self.record.parent_span_id = trace_id, span_id

    # --- the request ----------------------------------------------------------------------
    def request_body(self, body: bytes | bytearray | None, note: str | None = None) -> None:
        """The request body when it was held whole (None: none, or too large to read; `note` says)."""
        if self._dialect is not None and body is not None:
            self._info = read_request(self._dialect, body)
            self._request_body = body
        if note is not None:
            self._info.body_note = note
        info, record = self._info, self.record
        record.model, record.stream = info.model, info.stream
        record.requested_max_tokens, record.seed, record.temperature = (
            info.requested_max_tokens, info.seed, info.temperature)
        record.num_ctx, record.n, record.user_turn = info.num_ctx, info.n, info.user_turn
        record.request_note = info.body_note if info.body_note != "empty body" else None

    # --- the response ---------------------------------------------------------------------
    def response_head(self, status: int, content_type: str, content_encoding: str = "",
                      content_length: int | None = None) -> None:
        """The upstream answered: generations and any error body are read."""
        self.record.status = status
        if self.inference or status >= 400:
            dialect = self._dialect or FALLBACK
            structured = self.inference and (self._info.tools or self._info.json_format)
            self.tally = StreamTally(parser_for(dialect, content_type, content_encoding,
                                                max_line=self._limits.max_line_bytes,
                                                body_cap=self._limits.body_cap_bytes,
                                                parse_bytes=self._limits.parse_bytes, content_length=content_length,
                                                fast_path=self._limits.fast_path, texts=structured))
            if structured:  # the answer's structured text, kept to check it is whole (bounded)
                parse_bytes = self._limits.parse_bytes
                self.tally.texts = AnswerTexts(reserve=parse_bytes.reserve, release=parse_bytes.release)

    def chunk(self, data: bytes, now: float) -> None:
        """A chunk of the response body, already on its way to the client."""
        self.tally.feed(data, now)

    @property
    def chunk_sink(self) -> Callable[[bytes, float], None]:
        """`chunk` without the call through the recorder, for the relay's per-read path (valid
        from `response_head` on)."""
        return self.tally.feed

    @property
    def reads_sink(self) -> Callable[[list[Read], int], None]:
        """Chunks that were forwarded, each left in its read, their payloads' size in all
        (`StreamTally.feed_reads`; valid from `response_head` on)."""
        return self.tally.feed_reads

    def body_ended(self, now: float) -> None:
        """No more body bytes from `now` on (idempotent); what the tally still holds is parsed by
        `finish` (the relay's way: its finish runs with a batch, see `proxy.diagnosis.delivery`)."""
        if self._ended_at is None:
            self._ended_at = now

    @property
    def held_bytes(self) -> int:
        """The bytes a finished exchange's recorder still holds until `finish`: the request body
        (for the server's tokenizer) and the reads not parsed yet."""
        body = self._request_body
        return (0 if body is None else len(body)) + self.tally.pending_bytes

    # --- how it ended ---------------------------------------------------------------------
    def no_answer(self, error: UpstreamErrorKind, detail: str, status: int | None = None) -> None:
        """No usable answer came from the upstream (`status`: what the proxy answered instead)."""
        self.record.status = status
        self._connect_error = error
        self._error_detail = detail

    def upstream_broke(self, detail: str) -> None:
        """The upstream connection broke in the middle of the body."""
        self._reset = True
        self._error_detail = detail

    def client_left(self, detail: str | None = None) -> None:
        self._client_left = True
        if detail is not None and self._error_detail is None:
            self._error_detail = detail

    def not_admitted(self, detail: str) -> None:
        """The proxy's admission gate refused the request (its 503): `rejected`, with why."""
        self.record.status = 503
        self._not_admitted = detail

    def queued_at_proxy(self, seconds: float) -> None:
        """The request waited `seconds` at the proxy's admission gate before it went upstream."""
        self.record.queue_time_s, self.record.queue_time_source = round(seconds, QUEUE_TIME_RESOLUTION), "proxy"

    def deadline_enforced(self, kind: DeadlineHit, status: int | None = None) -> None:
        """The proxy cut the exchange at a deadline (`status`: its own answer, before any head)."""
        self._enforced = kind
        if status is not None:
            self.record.status = status

    def proxy_shutdown(self, status: int | None = None) -> None:
        """The proxy ended the exchange as it shut down (`status`: its own answer, before any head)."""
        self._shutdown = True
        if status is not None:
            self.record.status = status

    def proxy_failed(self, detail: str, status: int | None = None) -> None:
        """The proxy's own code failed on the exchange, which was then ended (`status`: its own
        answer, before any head). `detail` names the failure, never what the exchange carried."""
        self._proxy_failed = detail
        if status is not None:
            self.record.status = status

    def deadline_observed(self, kind: DeadlineHit) -> None:
        """A deadline passed but was not enforced (observe mode)."""
        self._deadline_observed = kind

    # --- what the relay did -----------------------------------------------------------------
    def admitted(self, at_start: int, deadline_mode: Literal["observe", "enforce"] | None = None) -> None:
        """Admitted with `at_start` generations in flight (itself included), under deadlines in
        `deadline_mode` (None: no deadline set)."""
        self.record.concurrency_at_start = at_start
        self.record.deadline_mode = deadline_mode

    def sent(self, retries: int) -> None:
        """The request went upstream, `retries` times again on another connection."""
        self.record.upstream_retries = retries

    def upstream_named(self, request_id: str) -> None:
        """The upstream answered with an `X-Request-Id` of its own (kept beside the proxy's)."""
        if request_id != self.record.request_id:
            self.record.upstream_request_id = utf8_text(request_id[:128])

    def known_as(self, request_id: str) -> None:
        """The exchange's id is this one after all (the sweep: the id the proxy answered with)."""
        self.record.request_id = request_id

    def concurrency(self, at_start: int, peak: int, mean: float) -> None:
        record = self.record
        record.concurrency_at_start, record.concurrency_peak, record.concurrency_mean = at_start, peak, mean

    @property
    def client_has_left(self) -> bool:
        return self._client_left

    @property
    def ended_at(self) -> float | None:
        return self._ended_at

    # --- the record -----------------------------------------------------------------------
    def finish(self, now: float | None = None, server: ServerIdentity = UNKNOWN_SERVER) -> ResponseRecord:
        """Classify and fill the record; call once, after the exchange has ended. `server` is what the
        upstream says of itself (which server, its context), for the prompt's fate."""
        for _ in self.finish_steps(now, server):
            pass
        return self.record

    def finish_steps(self, now: float | None = None, server: ServerIdentity = UNKNOWN_SERVER) -> Iterator[None]:
        """`finish` in steps (the reads left parsed a few at a time, then the record filled), yielding
        between two: the relay's reads go on between them (see `proxy.diagnosis.delivery`). The
        record is `self.record`, final once the steps are done."""
        self.body_ended(time.monotonic() if now is None else now)
        assert self._ended_at is not None
        yield from self.tally.close_steps(self._ended_at)  # what the tally still holds, parsed
        record, tally, info = self.record, self.tally, self._info
        record.duration_s = self._ended_at - self._started
        record.bytes_out = tally.bytes_out
        self._fill_tokens()
        if tally.streaming and tally.first_token_at is not None:
            record.ttft_s = tally.first_token_at - self._started
            record.itl_mean_s, record.itl_p95_s, record.itl_max_s = tally.itl_stats()
        if tally.finish is not None:
            record.finish_reason_raw = tally.finish.reason
            record.truncated_flag = tally.finish.truncated
        self._fill_timings()
        record.parse_error = tally.parse_errors > 0
        record.parse_error_detail = tally.parse_error
        diagnosis = classify(WireFacts(
            inference=self.inference, status=record.status, connect_error=self._connect_error,
            error_detail=self._error_detail, upstream_reset=self._reset, client_disconnected=self._client_left,
            enforced=self._enforced, proxy_shutdown=self._shutdown, proxy_failed=self._proxy_failed is not None,
            finish=tally.finish, error=tally.error,
            done=tally.done,
            parse_failed=record.parse_error, output_tokens=record.output_tokens,
            tokens_exact=record.tokens_source != "counted", requested_max_tokens=record.requested_max_tokens,
            n=record.n, stop_requested=info.stop_requested, stop_token_ids=info.stop_token_ids,
            streamed=tally.streaming, has_prompt=info.has_prompt,
            request_read=info.body_parsed or self._dialect is None, delivered=tally.tokens))
        record.stop_reason = diagnosis.stop_reason
        record.stop_reason_certain = diagnosis.certain
        record.length_cause = diagnosis.length_cause
        record.length_cause_source = diagnosis.length_cause_source
        record.upstream_error = diagnosis.upstream_error
        record.upstream_error_detail = diagnosis.upstream_error_detail
        if self._proxy_failed is not None:
            record.stop_detail = self._proxy_failed
        if self._not_admitted is not None:  # the proxy's own refusal, not the server's
            record.stop_reason, record.stop_detail = "rejected", self._not_admitted
            record.upstream_error = record.upstream_error_detail = None
        if tally.texts is not None:
            try:
                usability.judge(record, info, tally.texts)
            finally:
                tally.texts.drop()  # (the text goes now: it is never kept past the check)
        if record.stop_reason == "not_generated" and tally.finish is not None and tally.finish.stop == "eos":
            record.stop_detail = (f"the stream said {record.finish_reason_raw!r} without one piece of output: nothing "
                                  "was generated (LM Studio answers a prompt over its context this way, and says "
                                  "nothing more)")
        elif record.stop_reason == "not_generated":
            record.stop_detail = (f"the server generated nothing (done_reason {record.finish_reason_raw!r}): "
                                  + ("the chat has no user turn" if info.user_turn is False
                                     else "it treated the request as a model load"))
        if record.upstream_error == "exceeds_context" and record.prompt_tokens is None:
            counts = refusal_counts(record.upstream_error_detail)
            if counts is not None:  # the server's refusal states the prompt's count and the context
                record.prompt_tokens, record.prompt_tokens_source = counts[0], "server_error"
                record.context_tokens = counts[1]
        self._fill_prompt(server)
        if record.length_cause_source == "request_unread":
            record.length_cause_detail = f"not decided: the request was not read ({info.body_note or 'no body'})"
        elif record.length_cause == "server_limit" and record.length_cause_detail is None:
            record.length_cause_detail = server_limit_detail(record)
        if self._client_left:
            record.client_disconnected = True
            record.disconnect_phase = "before_first_token" if tally.first_token_at is None else "mid_stream"
        hit = self._enforced if self._enforced != "none" else self._deadline_observed
        if hit != "none":
            record.deadline_hit = hit
            record.deadline_mode = "enforce" if self._enforced != "none" else "observe"
        make_writable(record)  # whatever the wire held, the record can be written everywhere it goes

    def _fill_prompt(self, server: ServerIdentity) -> None:
        """The prompt's fate, by the server's own numbers and rules (see proxy.diagnosis.prompt_rules)."""
        record, info = self.record, self._info
        if not self.inference or not info.body_parsed:
            return
        record.context_tokens = context_of(record, info, server) or record.context_tokens
        finding = prompt_truncation(record, info, server)
        record.prompt_truncated, record.prompt_truncated_detail = finding.truncated, finding.detail

    def tokenizer_query(self) -> TokenizerQuery | None:
        """For a finished length stop whose cause the counted tokens left open: what the server's
        tokenizer needs to count its prompt. None when the record needs nothing more (or the proxy
        did not read the request)."""
        record, info = self.record, self._info
        body = self._request_body
        if (record.stop_reason != "length" or record.length_cause_source != "counted" or body is None
                or record.requested_max_tokens is None or not info.has_prompt or self._dialect is None):
            return None
        return TokenizerQuery(self._dialect.name, record.route, record.model, bytes(body),
                              record.requested_max_tokens, info.truncate_prompt_tokens)

    @staticmethod
    def settle_length(record: ResponseRecord, query: TokenizerQuery, kind: str, count: PromptCount | None,
                      note: str | None) -> None:
        """What the server's tokenizer said of a record from `tokenizer_query`: its prompt count decides
        the length cause by the server's own rule, or `note` says why it could not."""
        if count is None:
            record.length_cause_detail = note
            return
        if record.prompt_tokens is None:
            record.prompt_tokens, record.prompt_tokens_source = count.tokens, "tokenizer"
        if record.context_tokens is None:
            record.context_tokens = count.context
        cause, detail = length_cause_from_prompt(kind, count, query.requested_max_tokens,
                                                 query.truncate_prompt_tokens)
        record.length_cause, record.length_cause_detail = cause, detail
        if cause != "unknown":
            record.length_cause_source = "server_tokenizer"
        make_writable(record)

    def _fill_tokens(self) -> None:
        record, tally = self.record, self.tally
        usage = tally.usage
        ignored = [*self._info.ignored, *(usage.ignored if usage is not None else ())][:MAX_IGNORED]
        if ignored:  # counts out of any range: not said, and the record says what was left out
            record.values_ignored = ", ".join(ignored)[:200]
        if usage is not None and usage.completion_tokens is not None:
            record.output_tokens, record.tokens_source = usage.completion_tokens, "usage"
        elif self.inference and (tally.tokens or tally.finish is not None or tally.done):
            record.output_tokens, record.tokens_source = tally.tokens, "counted"
        if usage is not None:
            record.prompt_tokens = usage.prompt_tokens
            if usage.prompt_tokens is not None:
                record.prompt_tokens_source = "usage"
        if usage is not None and usage.reasoning_tokens is not None:
            record.reasoning_tokens = usage.reasoning_tokens
        elif tally.reasoning and tally.reasoning == tally.tokens and record.output_tokens is not None:
            # Thinking and nothing else: every token of the output went to it (Ollama's thinking that
            # spends the whole num_predict and leaves `content` empty), whatever counted the output.
            record.reasoning_tokens = record.output_tokens
        elif tally.streaming and record.output_tokens is not None:
            record.reasoning_tokens = tally.reasoning  # what the stream showed: 0 when it showed none
        record.usage_mismatch = usage_mismatch(usage, tally.tokens if tally.streaming else None)
        output, reasoning = record.output_tokens, record.reasoning_tokens
        if output is None or reasoning is None:
            return
        record.visible_tokens = max(0, output - reasoning)
        whole = record.requested_max_tokens or output
        record.reasoning_share = min(1.0, reasoning / whole) if whole else None

    def _fill_timings(self) -> None:
        timings = self.tally.timings
        if timings is None:
            return
        record = self.record
        record.server_timings = {k: v for k, v in (
            ("total_s", timings.total_s), ("load_s", timings.load_s), ("prompt_eval_s", timings.prompt_eval_s),
            ("eval_s", timings.eval_s), ("queue_s", timings.queue_s)) if v is not None}
        if timings.prompt_eval_s is not None or timings.eval_s is not None:
            record.server_prefill_s, record.server_decode_s = timings.prompt_eval_s, timings.eval_s
            record.server_times_source = timings.source
        if timings.queue_s is not None:  # the server's own (vLLM's per-request metrics)
            server_queue(record, round(timings.queue_s, QUEUE_TIME_RESOLUTION), timings.source)
        elif timings.total_s is not None:  # what the server's own durations leave unaccounted: queueing
            accounted = sum(v for v in (timings.load_s, timings.prompt_eval_s, timings.eval_s) if v)
            server_queue(record, max(0.0, round(timings.total_s - accounted, QUEUE_TIME_RESOLUTION)),
                         "server_durations")
