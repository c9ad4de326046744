"""Why a response ended: pure functions from what was seen on the wire to one stop reason.

Nothing here guesses, and nothing here knows a dialect: each dialect has already read its own
finish value into a canonical one (`events.Finish.stop`). Precedence, first match wins:
the proxy's own failure > connect failure > the proxy's shutdown > enforced deadline/idle timeout
> client gone before the answer's end > 429/503/529 > other HTTP error > error event > upstream reset
> the server's own finish reason > a stream ended without one (interrupted) > a body without one
> stream cut with no final event.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from proxy.record import LengthCause, LengthCauseSource, StopReason, UpstreamErrorKind
from proxy.wire.events import ErrorEvent, Finish

_OOM = re.compile(r"out of memory|\boom\b|cudaMalloc|failed to allocate|insufficient memory", re.IGNORECASE)
# The servers' own words for a context that ran out, checked against their sources:
# - the KV cache (a pool shared by the slots) filled up while generating: llama-server's
#   "Context size has been exceeded." (tools/server/server-context.cpp, a failed decode);
# - the request cannot fit the context one request gets: llama-server's
#   `exceed_context_size_error` ("request (N tokens) exceeds the available context size (M
#   tokens)", "input (N tokens) is larger than the max context size"), vLLM's "This model's
#   maximum context length is N tokens" and "max_tokens=N cannot be greater than
#   max_model_len=M", Ollama's "the input length exceeds the context length", OpenAI's
#   `context_length_exceeded`.
_CONTEXT_EXHAUSTED = re.compile(r"context size has been exceeded|kv cache is full|out of kv cache", re.IGNORECASE)
_EXCEEDS_CONTEXT = re.compile(
    r"exceeds the available context size|larger than the max context size|maximum context length"
    r"|greater than max_model_len|input length exceeds the context length|context_length_exceeded"
    r"|exceed_context_size_error|prompt is too long|longer than the model's context length"
    # LM Studio, with a 200 or a 400 (lmstudio-bug-tracker#546, #2322): "Trying to keep the first N tokens
    # when context the overflows. However, the model is loaded with context length of only M tokens"
    r"|when context the overflows", re.IGNORECASE)
# The counts in those refusals, the prompt's and the context's (group names), checked against the sources:
# llama-server (tools/server/server-context.cpp), vLLM (vllm/renderers/params.py, _token_len_check; older
# releases' serving_engine.py) and SGLang (python/sglang/srt/managers/tokenizer_manager.py, _validate_one_request).
_REFUSAL_COUNTS = tuple(re.compile(pattern, re.IGNORECASE) for pattern in (
    r"request \((?P<prompt>\d+) tokens\) exceeds the available context size \((?P<context>\d+) tokens\)",
    r"input \((?P<prompt>\d+) tokens\) is larger than the max context size \((?P<context>\d+) tokens\)",
    r"maximum context length is (?P<context>\d+) tokens\. However, your prompt contains (?P<prompt>\d+) input tokens",
    r"maximum context length is (?P<context>\d+) tokens\. However, your request has (?P<prompt>\d+) input tokens",
    r"maximum context length is (?P<context>\d+) tokens\. However, you requested \d+ output tokens and your prompt "
    r"contains (?P<prompt>\d+) input tokens",
    r"maximum context length is (?P<context>\d+) tokens\. However, you requested \d+ tokens \((?P<prompt>\d+) in "
    r"the messages",
    r"maximum context length of (?P<context>\d+) tokens\. You requested a total of \d+ tokens: (?P<prompt>\d+) "
    r"tokens from the input messages",
    r"the input \((?P<prompt>\d+) tokens\) is longer than the model's context length \((?P<context>\d+) tokens\)",
))
# A count past this is no prompt's
MAX_SANE_TOKENS = 1 << 40
# Statuses that mean "not now": rate limits, an unavailable server, Anthropic's 529 overloaded.
REJECTED_STATUSES = frozenset({429, 503, 529})


@dataclass(frozen=True, slots=True)
class WireFacts:
    """What the forwarding path and the parser saw; the input of `classify`."""

    inference: bool
    status: int | None
    connect_error: UpstreamErrorKind | None = None
    error_detail: str | None = None
    upstream_reset: bool = False
    client_disconnected: bool = False
    enforced: str = "none"  # none | total | idle
    proxy_shutdown: bool = False  # the proxy itself ended the exchange as it shut down
    proxy_failed: bool = False  # the proxy's own code failed on the exchange, which it then ended
    finish: Finish | None = None
    error: ErrorEvent | None = None
    done: bool = False
    parse_failed: bool = False
    output_tokens: int | None = None
    tokens_exact: bool = True  # False: output_tokens is a lower bound (content chunks counted)
    requested_max_tokens: int | None = None
    n: int | None = None
    stop_requested: bool = False
    stop_token_ids: tuple[int, ...] = ()
    streamed: bool = False  # the body was a stream of events, not one JSON document
    has_prompt: bool = False  # the request asked for a generation (it carried messages or a prompt)
    request_read: bool = True  # False: the request body was not read, so its budget is not known
    delivered: int | None = None  # pieces of output the stream itself carried (None: not counted)


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """The canonical outcome of one response."""

    stop_reason: StopReason
    length_cause: LengthCause | None = None
    certain: bool = True
    upstream_error: UpstreamErrorKind | None = None
    upstream_error_detail: str | None = None
    length_cause_source: LengthCauseSource | None = None


def refusal_counts(message: str | None) -> tuple[int, int] | None:
    """The prompt's tokens and the context, as a server's refusal of an over-long prompt states
    them; None when it states no such counts. vLLM's "at least N input tokens" (its tokenizer
    stopped counting at the context) is a lower bound, not the prompt's count: None."""
    if not message:
        return None
    for pattern in _REFUSAL_COUNTS:
        found = pattern.search(message)
        if found is not None:
            prompt, context = int(found["prompt"]), int(found["context"])
            return (prompt, context) if 0 < prompt < MAX_SANE_TOKENS and 0 < context < MAX_SANE_TOKENS else None
    return None


def is_oom(message: str) -> bool:
    """True when an error text says the server ran out of (GPU) memory."""
    return _OOM.search(message) is not None


def error_kind(error: ErrorEvent | None, fallback: UpstreamErrorKind) -> UpstreamErrorKind:
    """What a server's error says ran out: the context (pool or per request), memory, or `fallback`."""
    if error is None:
        return fallback
    said = f"{error.type or ''} {error.message}"
    if _CONTEXT_EXHAUSTED.search(said):
        return "context_exhausted"
    if _EXCEEDS_CONTEXT.search(said):
        return "exceeds_context"
    if is_oom(error.message):
        return "oom"
    return fallback


def length_cause(output_tokens: int | None, requested: int | None, n: int | None, *,
                 exact: bool = True) -> LengthCause:
    """`requested_budget` when the length stop came at the client's budget, `server_limit` before it.

    No budget requested means the server's own limit decided (its default, or the context).
    A count that is only a lower bound (content chunks, when the server sent no usage: one chunk
    can carry several tokens, or none that shows as text) proves a stop at the budget when it
    reaches it, but never a stop before it: then the cause is `unknown`, not `server_limit`.
    """
    return length_cause_with_source(output_tokens, requested, n, exact=exact)[0]


def length_cause_with_source(output_tokens: int | None, requested: int | None, n: int | None, *,
                             exact: bool = True) -> tuple[LengthCause, LengthCauseSource]:
    """`length_cause`, with what decided it (see `LengthCauseSource`)."""
    if requested is None:
        return "server_limit", "no_budget"
    if output_tokens is None:
        return "unknown", "none"
    per_choice = output_tokens / n if n and n > 1 else output_tokens
    if per_choice >= requested:
        return "requested_budget", "output_count"
    return ("server_limit", "output_count") if exact else ("unknown", "counted")


def _ended_before_the_client_left(facts: WireFacts) -> bool:
    """The answer's own end was relayed before the client went: the stream's end (`[DONE]`,
    `done: true`, `message_stop`, a whole body), or the finish of its one choice. What the client
    did after it does not change why the answer ended (a client may close on the finish without
    waiting for `[DONE]`); with several choices one finish is not the end of the others."""
    return facts.done or (facts.finish is not None and (facts.n or 1) <= 1)


def classify(facts: WireFacts) -> Diagnosis:
    if facts.proxy_failed:  # whatever else was seen, what the client got ended there
        return Diagnosis("proxy_error")
    if facts.connect_error is not None:
        return Diagnosis("upstream_error", upstream_error=facts.connect_error,
                         upstream_error_detail=facts.error_detail)
    if facts.proxy_shutdown:
        return Diagnosis("proxy_shutdown")
    if facts.enforced == "total":
        return Diagnosis("deadline")
    if facts.enforced == "idle":
        return Diagnosis("idle_timeout")
    if facts.client_disconnected and facts.error is None and not _ended_before_the_client_left(facts):
        # (A server's error event the client was sent before it left ended the answer: a client that
        # leaves on it, as the official ones do when they raise, left because of it.)
        return Diagnosis("client_disconnect")
    status = facts.status or 0
    error = facts.error
    if status in REJECTED_STATUSES or (error is not None and error.overloaded):
        return Diagnosis("rejected", upstream_error_detail=_message(error))
    if status >= 400:
        message = _message(error)
        return Diagnosis("upstream_error", upstream_error=error_kind(error, "http_status"),
                         upstream_error_detail=f"HTTP {status}" + (f": {message}" if message else ""))
    if not facts.inference:
        return Diagnosis("not_inference")
    if error is not None:
        return Diagnosis("upstream_error", upstream_error=error_kind(error, "error_event"),
                         upstream_error_detail=error.message)
    if facts.upstream_reset:
        return Diagnosis("upstream_disconnect", upstream_error="reset", upstream_error_detail=facts.error_detail)
    finish = facts.finish
    if finish is not None:
        return _finished(finish, facts)
    if facts.done and facts.streamed and not facts.parse_failed:
        # The server ended the stream itself ([DONE], message_stop) without saying why: llama-cpp-
        # python's server does so to a running stream when another request queues, before its first
        # token or after. (A `[DONE]` alone is also how a llama.cpp-based server over its context
        # answers, NousResearch/hermes-agent#51448: the wire does not tell the two apart.)
        return Diagnosis("interrupted")
    if facts.done or facts.parse_failed:
        return Diagnosis("unknown")  # a body without a reason, or bytes we could not read
    return Diagnosis("upstream_disconnect")


def _finished(finish: Finish, facts: WireFacts) -> Diagnosis:
    """The server's own finish, read by its dialect."""
    if finish.upstream_error is not None:  # vLLM's abort and error: the engine failed the request
        return Diagnosis("upstream_error", upstream_error=finish.upstream_error,
                         upstream_error_detail=f"finish_reason={finish.reason}")
    if finish.stop == "length":
        if finish.context_limit:  # the server says the context, not the budget, ended it
            return Diagnosis("length", length_cause="server_limit", length_cause_source="server_finish")
        if not facts.request_read:  # no budget read is not "no budget asked"
            return Diagnosis("length", length_cause="unknown", length_cause_source="request_unread")
        cause, source = length_cause_with_source(facts.output_tokens, facts.requested_max_tokens, facts.n,
                                                 exact=facts.tokens_exact)
        return Diagnosis("length", length_cause=cause, length_cause_source=source)
    if finish.stop == "eos" and finish.limit_blind:
        # The server says the same for EOS and for a limit: with the whole budget spent, the budget
        # most likely ended it; otherwise EOS or a full context. Neither is proven.
        if facts.tokens_exact and length_cause(facts.output_tokens, facts.requested_max_tokens,
                                               facts.n) == "requested_budget":
            return Diagnosis("length", length_cause="requested_budget", certain=False,
                             length_cause_source="output_count")
        return Diagnosis("eos", certain=False)
    if finish.stop == "eos" and finish.matched_token is not None and finish.matched_token in facts.stop_token_ids:
        return Diagnosis("stop_sequence")  # SGLang names the token: one the client asked to stop at
    if finish.stop == "eos" and facts.stop_requested and not finish.distinguishes_stop:
        # llama.cpp's and Ollama's OpenAI output say "stop" for both: EOS is not proven.
        return Diagnosis("eos", certain=False)
    if finish.stop == "not_inference" and facts.has_prompt and not facts.output_tokens:
        # Ollama's `load`/`unload` to a request that carried a prompt: nothing was generated
        # (a chat without a user turn, for one); not a model listing.
        return Diagnosis("not_generated")
    if finish.stop == "eos" and empty_stream(facts):
        # A 200 stream that ended "stop" without one piece of output: LM Studio answers a prompt
        # over its context so, its usage counting tokens all the same (lmstudio-bug-tracker#2339).
        # Nothing was generated; not an answer.
        return Diagnosis("not_generated")
    return Diagnosis(finish.stop)


def empty_stream(facts: WireFacts) -> bool:
    """A stream for a request that asked for a generation, which carried no output at all: no
    content, reasoning or tool call (what its usage says it counted is no output delivered)."""
    return facts.streamed and facts.has_prompt and facts.delivered == 0 and not facts.parse_failed


def _message(error: ErrorEvent | None) -> str | None:
    return None if error is None else error.message
