"""The response record: one per proxied response, the unit everything downstream consumes."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, fields
from typing import Any, Literal

StopReason = Literal[
    "eos",
    "stop_sequence",
    "length",
    "tool_calls",
    "content_filter",
    "repetition",
    "client_disconnect",
    "upstream_disconnect",
    "interrupted",
    "deadline",
    "idle_timeout",
    "proxy_shutdown",
    "proxy_error",
    "upstream_error",
    "rejected",
    "not_generated",
    "not_inference",
    "unknown",
]
STOP_REASONS: tuple[str, ...] = StopReason.__args__  # type: ignore[attr-defined]

# Stop reasons that mean the answer is complete; everything else counts as truncated.
COMPLETE_STOP_REASONS = frozenset({"eos", "stop_sequence", "tool_calls"})

# Who ended an answer, the question the metrics answer first:
#   complete       it ended on its own
#   budget         at the max_tokens the client asked for: the client's choice
#   cut            the serving layer ended it: a server limit, an error, a deadline, a refusal
#   client_gone    the client went away
#   client_error   the server refused the request as malformed (an HTTP 4xx of the client's making)
#   unknown        the wire does not say (a length stop below the budget whose tokens were only counted)
#   not_inference  not a generation (a model listing, a scrape)
Outcome = Literal["complete", "budget", "cut", "client_gone", "client_error", "unknown", "not_inference"]
OUTCOMES: tuple[str, ...] = Outcome.__args__  # type: ignore[attr-defined]
# Why, in the words an operator fixes it by: the stop reason, with a length stop told by its
# cause and an upstream error by its kind. The `cause` label of the request metrics.
CUT_CAUSES: tuple[str, ...] = (
    "server_limit", "content_filter", "repetition", "upstream_disconnect", "interrupted", "deadline",
    "idle_timeout", "proxy_shutdown", "proxy_error", "rejected", "http_5xx", "connect", "timeout", "reset", "oom",
    "error_event", "abort", "context_exhausted", "exceeds_context", "not_generated", "answer_incomplete",
    "model_unloaded", "undelivered")
# Ends that a model leaving while the answer ran explains: the answer stopped with no word of why.
_UNLOADED_ENDS = frozenset({"upstream_disconnect", "interrupted", "not_generated", "upstream_error", "unknown"})
CAUSES: tuple[str, ...] = (
    "eos", "stop_sequence", "tool_calls", "requested_budget", *CUT_CAUSES, "client_disconnect", "http_4xx",
    "no_user_turn", "length_unknown", "unknown", "not_inference")
_ERROR_CAUSES = frozenset({"connect", "timeout", "reset", "oom", "error_event", "abort", "context_exhausted",
                           "exceeds_context"})

# A length stop whose budget went at least this share to reasoning is "mostly reasoning".
REASONING_HEAVY_SHARE = 0.5

LengthCause = Literal["requested_budget", "server_limit", "unknown"]
# How a length cause was decided: the output's count against the budget (`output_count`), no budget
# asked (`no_budget`), the server naming the context (`server_finish`), or the prompt counted by the
# server's own tokenizer against its context (`server_tokenizer`); `counted` for an `unknown` whose
# count was only a lower bound, `none` for one with no count at all, `request_unread` when the proxy
# could not read what budget the client asked for (over the parse cap, not JSON).
LengthCauseSource = Literal["output_count", "no_budget", "server_finish", "server_tokenizer", "counted", "none",
                            "request_unread", "server_trace"]
UpstreamErrorKind = Literal["http_status", "connect", "timeout", "reset", "oom", "error_event", "abort",
                            "context_exhausted", "exceeds_context"]
UPSTREAM_ERROR_KINDS: tuple[str, ...] = UpstreamErrorKind.__args__  # type: ignore[attr-defined]
DeadlineKind = Literal["none", "total", "idle"]


# The largest count of tokens (or of anything else a server or client counts) the proxy takes as
# said: past it, or below 0, a value is no count but a fault, and is left out with a note
# (`values_ignored`). Sums of a few such counts stay far inside what JSON, SQLite, PostgreSQL,
# Prometheus (a float's exact integers) and OTLP take.
MAX_COUNT = 1 << 40
# What a record's integers must fit: SQLite's and PostgreSQL's BIGINT, OTLP's int64.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_IGNORED = 4  # values noted as ignored, per record

# The concurrency a record saw, as a bounded label: the buckets of every metric and filter.
CONCURRENCY_BUCKETS = ("1", "2", "4", "8", "16", "32", "64", "128+")


def concurrency_bucket(value: int) -> str:
    """The smallest power of two >= value, as a label: `1`, `2`, `4`, ... `64`, then `128+`."""
    if value <= 1:
        return "1"
    if value > 64:
        return "128+"
    return str(1 << (value - 1).bit_length())


@dataclass(slots=True)
class RequestInfo:
    """What the client asked for, read from a copy of the request body."""

    model: str | None = None
    stream: bool | None = None
    requested_max_tokens: int | None = None
    num_ctx: int | None = None
    seed: int | None = None
    temperature: float | None = None
    n: int | None = None
    stop_requested: bool = False
    stop_token_ids: tuple[int, ...] = ()  # token ids the client asked to stop at (vLLM, SGLang)
    reasoning_budget: int | None = None  # Anthropic's thinking.budget_tokens
    body_parsed: bool = False
    body_note: str | None = None
    # The prompt, as far as the proxy can tell without the server's tokenizer:
    has_prompt: bool = False  # the request carries messages or a prompt (a generation was asked for)
    user_turn: bool | None = None  # a chat with a user message in it (None: not a chat)
    prompt_words: int | None = None  # whitespace-separated words in the user's turns: a lower bound in tokens
    # Every message's text, all roles (a server that renders every message, Ollama's templates):
    all_words: int | None = None  # its words: a lower bound in tokens
    all_bytes: int | None = None  # its UTF-8 bytes (None: a part the proxy cannot size, an image)
    messages: int = 0  # messages in the chat (1 for a completion's prompt)
    tools: bool = False  # the request offers tools (their definitions are rendered into the prompt)
    json_format: bool = False  # the request asks for a JSON answer (a response format, a schema)
    truncate_prompt_tokens: int | None = None  # vLLM's: the client asks to keep only the last N
    n_keep: int | None = None  # llama.cpp's: prompt tokens a context shift keeps
    ignored: list[str] = field(default_factory=list)  # values out of range, left out (`name=value`)


# What the GPU and the server were doing while a response ran (`during` it): what an enricher knows,
# by the name of the record field each fills (written by the diagnosis; one left out or None leaves
# the field as it is).
DuringField = Literal["gpu", "vram_free_min_bytes", "vram_used_max_bytes", "upstream_running_max",
                     "upstream_waiting_max", "kv_cache_usage_max", "preemptions_during", "preemptions_scope",
                     "model_unloaded", "kv_blocks_held", "kv_pool_share"]
DURING_FIELDS: tuple[str, ...] = DuringField.__args__  # type: ignore[attr-defined]
ServerDuring = dict[DuringField, "str | int | float | None"]


@dataclass(slots=True)
class ResponseRecord:
    """Why one response ended, under how much concurrency, and how fast its tokens came.

    Figures that are estimates say so: `tokens_source` is `counted` when the output token
    count comes from counting content chunks rather than from the server's own count; such a
    count is a lower bound (a chunk can carry several tokens, or one that shows no text yet).
    """

    request_id: str
    method: str
    path: str
    route: str
    dialect: str  # a name from proxy.wire.dialects.NAMES, or "none" for a route that is not a generation
    started_at: float  # unix time
    instance: str | None = None  # the proxy that saw it (--instance; default its host name and listen port)
    upstream: str | None = None  # the server it went to (the upstream URL, credentials taken out)
    client: str | None = None  # who sent it: a keyed hash of its API key (`key:…`), or --client-header's value
    model: str | None = None
    stream: bool | None = None
    status: int | None = None
    requested_max_tokens: int | None = None
    output_tokens: int | None = None
    tokens_source: Literal["usage", "counted", "none", "server_trace"] = "none"
    prompt_tokens: int | None = None
    reasoning_tokens: int | None = None  # of output_tokens, spent thinking (the server's count, else counted)
    visible_tokens: int | None = None  # output_tokens minus reasoning_tokens: the answer the user sees
    reasoning_share: float | None = None  # reasoning_tokens over the requested budget (else over the output)
    stop_reason: StopReason = "unknown"
    stop_reason_certain: bool = True  # False: the server's "stop" covers EOS and a stop string alike
    finish_reason_raw: str | None = None
    length_cause: LengthCause | None = None
    length_cause_source: LengthCauseSource | None = None
    length_cause_detail: str | None = None  # how the server's own numbers decided it, or why they could not
    stop_detail: str | None = None  # what the stop means where its name does not say it (not_generated: why)
    # Whether the answer can be used, for a request that asked for structure (tools, a JSON format):
    # every tool call's arguments and a JSON answer whole at its end (None: not asked, or not known).
    answer_complete: bool | None = None
    incomplete_part: Literal["tool_call", "json"] | None = None  # which part was not whole
    incomplete_detail: str | None = None  # why not, or why it could not be checked (never the text itself)
    usage_mismatch: str | None = None  # the server's own counts that cannot both be true, with both numbers
    user_turn: bool | None = None  # the chat carried a user message (None: not a chat, or not read)
    # the server's report (usage), its tokenizer, or the count in its refusal of an over-long prompt
    prompt_tokens_source: Literal["usage", "tokenizer", "server_error", "server_trace"] | None = None
    context_tokens: int | None = None  # the context the server gives one request, where it says
    prompt_truncated: bool | None = None  # the server cut the prompt on the way in; None: cannot know
    prompt_truncated_detail: str | None = None  # how that was decided
    concurrency_at_start: int = 0
    concurrency_peak: int = 0
    concurrency_mean: float = 0.0
    # How long it waited before it ran: at the proxy's admission gate (`proxy`, --max-in-flight) where
    # the gate held it, else in the server's own queue (the sources of `server_queue_s`).
    queue_time_s: float | None = None
    queue_time_source: str | None = None
    server_queue_s: float | None = None  # the server's own queue time, gate or not (source: server_times_source)
    ttft_s: float | None = None
    itl_mean_s: float | None = None
    itl_p95_s: float | None = None
    itl_max_s: float | None = None
    duration_s: float = 0.0
    deadline_hit: DeadlineKind = "none"
    deadline_mode: Literal["observe", "enforce"] | None = None
    client_disconnected: bool = False
    disconnect_phase: Literal["before_first_token", "mid_stream"] | None = None
    upstream_error: UpstreamErrorKind | None = None
    upstream_error_detail: str | None = None
    upstream_retries: int = 0  # an idempotent request sent again after a pooled connection turned out closed
    upstream_request_id: str | None = None  # the upstream's own X-Request-Id, where it differs from ours
    request_note: str | None = None  # why the request body was not read (past the cap, or --parse-bytes ran out)
    trace_id: str | None = None  # from the client's W3C traceparent (32 hex), when it sent a valid one
    parent_span_id: str | None = None  # the client's span in that traceparent (16 hex)
    parse_error: bool = False
    parse_error_detail: str | None = None
    bytes_out: int = 0
    seed: int | None = None
    temperature: float | None = None
    num_ctx: int | None = None
    n: int | None = None
    truncated_flag: bool | None = None  # llama.cpp's own `truncated`
    server_timings: dict[str, float] | None = None
    # The server's own account of the request: its durations (`server_times_source`: `server_durations`
    # from Ollama's and llama.cpp's answers, `server_metrics` from vLLM's `metrics`, `server_trace` from
    # its span), and what its span (`server_trace`: `joined`, or `missing` with why) says beside the wire.
    server_prefill_s: float | None = None
    server_decode_s: float | None = None
    server_times_source: str | None = None
    server_trace: Literal["joined", "missing"] | None = None
    server_trace_detail: str | None = None
    server_output_tokens: int | None = None  # the tokens the server says it generated (its span)
    undelivered: bool | None = None  # the server finished an answer the wire did not carry to its end
    undelivered_detail: str | None = None  # both counts, and where the cut can be
    server_after_disconnect_s: float | None = None  # the server's end after the client left
    server_aborted: bool | None = None  # False: it ran the answer to its end after the client left
    kv_blocks_held: int | None = None  # KV-cache blocks the request held at its end (prompt + output)
    kv_pool_share: float | None = None  # those blocks over the server's pool
    # Correlation with GPU memory and the server's own state (telemetry observers fill these).
    gpu: str | None = None
    vram_free_min_bytes: int | None = None
    vram_used_max_bytes: int | None = None
    upstream_running_max: float | None = None
    upstream_waiting_max: float | None = None
    kv_cache_usage_max: float | None = None
    preemptions_during: float | None = None
    preemptions_scope: str | None = None
    model_unloaded: bool | None = None  # the server's own state showed the answer's model gone while it ran
    observer_errors: list[str] = field(default_factory=list)
    # Values read from the wire but not taken, out of any sane range (`prompt_eval_count=-5`): "not said"
    values_ignored: str | None = None

    def to_compact_dict(self) -> dict[str, Any]:
        """`to_dict()` without the fields that are None (what a stored record needs: they are the
        defaults `record_from_dict` puts back), in one pass."""
        out = {name: value for name, value in zip(_RECORD_FIELDS, _record_values(self), strict=True)
               if value is not None}
        out["cause"] = self.cause
        out["outcome"] = self.outcome
        return out

    def to_dict(self) -> dict[str, Any]:
        """The fields as a flat dict (a shallow copy: dataclasses.asdict's deep copy costs ~10x), with
        the `cause` and `outcome` the metrics count it under."""
        out = dict(zip(_RECORD_FIELDS, _record_values(self), strict=True))
        out["cause"] = self.cause
        out["outcome"] = self.outcome
        return out

    @property
    def truncated(self) -> bool:
        """True when the answer did not end on its own (see COMPLETE_STOP_REASONS)."""
        return self.stop_reason not in COMPLETE_STOP_REASONS and self.stop_reason != "not_inference"

    @property
    def budget_mostly_reasoning(self) -> bool:
        """A length stop whose budget went mostly to thinking: the visible answer got what was left."""
        return self.stop_reason == "length" and (self.reasoning_share or 0.0) >= REASONING_HEAVY_SHARE

    @property
    def cause(self) -> str:
        """Why it ended, one of CAUSES: the stop reason, a length stop by its `length_cause`, an
        upstream error by its kind (an HTTP error by its class: 4xx or 5xx). A request that is not
        a generation is `not_inference` however it ended (its failures count as upstream errors)."""
        stop = self.stop_reason
        if self.route == "other":
            return "not_inference"
        if self.model_unloaded and stop in _UNLOADED_ENDS:
            return "model_unloaded"  # its model was unloaded, swapped or evicted while it ran
        if self.undelivered and stop in _UNLOADED_ENDS:
            return "undelivered"  # the server finished it; the way to the client cut it
        if stop == "length":
            if self.length_cause == "requested_budget":
                return "requested_budget"
            return "server_limit" if self.length_cause == "server_limit" else "length_unknown"
        if stop == "upstream_error":
            kind = self.upstream_error
            if kind in _ERROR_CAUSES:
                return kind
            return "http_4xx" if self.status is not None and 400 <= self.status < 500 else "http_5xx"
        if stop == "not_generated" and self.user_turn is False:
            return "no_user_turn"  # the client sent a chat the server had nothing to answer in
        if self.answer_complete is False and stop in COMPLETE_STOP_REASONS:
            return "answer_incomplete"  # it said it ended, and its tool call or JSON is not whole
        return stop

    @property
    def outcome(self) -> str:
        """Who ended it, one of OUTCOMES (see there); `unknown` for a cause this version does not know."""
        return _OUTCOME_OF.get(self.cause, "unknown")

    @property
    def truncation_cause(self) -> str | None:
        """The cause label of `llm_proxy_truncated_total`: what the serving layer cut, else None."""
        cause = self.cause
        return cause if _OUTCOME_OF.get(cause) == "cut" else None


_RECORD_FIELDS = tuple(f.name for f in fields(ResponseRecord))
_record_values = operator.attrgetter(*_RECORD_FIELDS)  # every field in one C call
RECORD_FIELDS = frozenset(_RECORD_FIELDS)
# The text fields; some hold text from outside the proxy (a client's body, a server's header or answer).
TEXT_FIELDS = tuple(f.name for f in fields(ResponseRecord) if f.type in ("str", "str | None"))
# The integer fields: each must fit a signed 64-bit integer (SQLite, PostgreSQL's BIGINT, OTLP).
INT_FIELDS = tuple(f.name for f in fields(ResponseRecord) if f.type in ("int", "int | None"))
OPTIONAL_INT_FIELDS = frozenset(f.name for f in fields(ResponseRecord) if f.type == "int | None")


def utf8_text(text: str) -> str:
    """`text` as it can be written in UTF-8: a lone surrogate (a `\\ud800` escape in a client's JSON,
    a header byte that is not UTF-8, as aiohttp decodes it) becomes `?`."""
    if text.isascii():
        return text
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode()
    return text





class CompactOnce:
    """A finished record's compact dict, made once for all the observers of its delivery (the log
    line and the history's row both need it): `delivering(record)` while the delivery runs, `compact`
    from any observer. Outside a delivery it is made each time. One per delivery, passed to the
    observers that use it (never a module's global); only the event loop's thread uses it."""

    __slots__ = ("_compact", "_record")

    def __init__(self) -> None:
        self._record: ResponseRecord | None = None
        self._compact: dict[str, Any] | None = None

    def delivering(self, record: ResponseRecord | None) -> None:
        """The record being delivered now (None: the delivery ended)."""
        self._record, self._compact = record, None

    def compact(self, record: ResponseRecord) -> dict[str, Any]:
        """`record.to_compact_dict()`; the same dict for every observer of one delivery, which none
        of them changes."""
        if record is not self._record:
            return record.to_compact_dict()
        if self._compact is None:
            self._compact = record.to_compact_dict()
        return self._compact



def record_from_dict(data: dict[str, Any]) -> ResponseRecord:
    """A record back from `to_dict()` (a worker's, the admin API's JSON); derived keys are left out."""
    if data.keys() <= RECORD_FIELDS:  # (a worker's record: nothing to leave out, found in one C call)
        return ResponseRecord(**data)
    return ResponseRecord(**{k: v for k, v in data.items() if k in RECORD_FIELDS})


# The named values of a record, and what a stored value this version does not know is read as.
_CHOICES: tuple[tuple[str, frozenset[Any], Any], ...] = (
    ("stop_reason", frozenset(STOP_REASONS), "unknown"),
    ("length_cause", frozenset((*LengthCause.__args__, None)), "unknown"),  # type: ignore[attr-defined]
    ("length_cause_source", frozenset((*LengthCauseSource.__args__, None)), None),  # type: ignore[attr-defined]
    ("upstream_error", frozenset((*UPSTREAM_ERROR_KINDS, None)), "error_event"),
    ("tokens_source", frozenset(("usage", "counted", "none", "server_trace")), "none"),
    ("prompt_tokens_source", frozenset(("usage", "tokenizer", "server_error", "server_trace", None)), None),
    ("server_trace", frozenset(("joined", "missing", None)), None),
    ("deadline_hit", frozenset(DeadlineKind.__args__), "none"),  # type: ignore[attr-defined]
    ("deadline_mode", frozenset(("observe", "enforce", None)), None),
    ("disconnect_phase", frozenset(("before_first_token", "mid_stream", None)), None),
)
_REQUIRED_TEXT = ("request_id", "method", "path", "route", "dialect")


def record_from_stored(data: Any) -> ResponseRecord | None:
    """A record read back from a history another version may have written: what this version does
    not know is read as far as it can be (an unknown field left out, an unknown stop reason or cause
    read as `unknown`, with the stored value named in `values_ignored`, a value of the wrong type
    not said); a row that is no record at all (not an object, no id or start time) is None, for the
    reader to count and skip. The stored values are mended before the record is made, never after."""
    if not isinstance(data, dict) or not all(isinstance(data.get(name), str) for name in _REQUIRED_TEXT):
        return None
    started = data.get("started_at")
    if not isinstance(started, int | float) or isinstance(started, bool) or not math.isfinite(started):
        return None
    values = {name: value for name, value in data.items() if name in RECORD_FIELDS}
    notes = [values["values_ignored"]] if isinstance(values.get("values_ignored"), str) else []
    for name, known, default in _CHOICES:
        value = values.get(name, _DEFAULTS[name])
        if value not in known:
            values[name] = default
            notes.append(f"{name}={str(value)[:40]}")
    for name in INT_FIELDS:  # a number of another type, or past 64 bits: not said (0 where one is needed)
        value = values.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or not INT64_MIN <= value <= INT64_MAX):
            values[name] = None if name in OPTIONAL_INT_FIELDS else 0
    for name in TEXT_FIELDS:
        value = values.get(name)
        if value is not None and not isinstance(value, str):
            values[name] = None if name not in _REQUIRED_TEXT else str(value)
        elif isinstance(value, str):
            values[name] = utf8_text(value)
    errors = values.get("observer_errors")
    values["observer_errors"] = [utf8_text(e) for e in errors if isinstance(e, str)] if isinstance(errors, list) else []
    timings = values.get("server_timings")
    if timings is not None:
        values["server_timings"] = ({str(k): v for k, v in timings.items() if isinstance(v, int | float)
                                     and not isinstance(v, bool) and math.isfinite(v)}
                                    if isinstance(timings, dict) else None)
    if notes:
        values["values_ignored"] = ", ".join(notes)[:200]
    try:
        return ResponseRecord(**values)
    except TypeError:
        return None


_DEFAULTS = {f.name: f.default for f in fields(ResponseRecord)}


_OUTCOME_OF: dict[str, str] = {
    **dict.fromkeys(("eos", "stop_sequence", "tool_calls"), "complete"), "requested_budget": "budget",
    **dict.fromkeys(CUT_CAUSES, "cut"), "client_disconnect": "client_gone", "http_4xx": "client_error",
    "no_user_turn": "client_error", "length_unknown": "unknown", "unknown": "unknown",
    "not_inference": "not_inference"}
