"""Why a response ended: pure functions from what was seen on the wire to one stop reason.

Nothing here guesses. Precedence, first match wins:
connect failure > enforced deadline/idle timeout > client gone > 429/503 > other HTTP error
> error event > upstream reset > the server's own finish reason > explicit end without one
> stream cut with no final event.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from proxy.events import ErrorEvent, Finish
from proxy.record import LengthCause, StopReason, UpstreamErrorKind

_OOM = re.compile(r"out of memory|\boom\b|cudaMalloc|failed to allocate|insufficient memory", re.IGNORECASE)

# OpenAI-compatible finish_reason values (vLLM, Ollama /v1, llama.cpp, SGLang, LM Studio).
_OPENAI_FINISH: dict[str, StopReason] = {
    "stop": "eos",
    "eos": "eos",
    "length": "length",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
    "content_filter": "content_filter",
    # vLLM 0.32 (vllm/v1/engine/__init__.py, FINISH_REASON_STRINGS): the engine cut a degenerate
    # answer because the client's `repetition_detection` found a repeating token pattern.
    "repetition": "repetition",
}
# Ollama's done_reason (server/routes.go): stop, length, load, unload.
_OLLAMA_DONE: dict[str, StopReason] = {
    "stop": "eos",
    "length": "length",
    "load": "not_inference",
    "unload": "not_inference",
}
# llama.cpp's native stop_type (tools/server): eos, word (a stop string), limit (n_predict or context).
_LLAMACPP_STOP: dict[str, StopReason] = {"eos": "eos", "word": "stop_sequence", "limit": "length"}


@dataclass(frozen=True, slots=True)
class WireFacts:
    """What the forwarding path and the parser saw; the input of `classify`."""

    dialect: str
    inference: bool
    status: int | None
    connect_error: UpstreamErrorKind | None = None
    error_detail: str | None = None
    upstream_reset: bool = False
    client_disconnected: bool = False
    enforced: str = "none"  # none | total | idle
    finish: Finish | None = None
    error: ErrorEvent | None = None
    done: bool = False
    parse_failed: bool = False
    output_tokens: int | None = None
    tokens_exact: bool = True  # False: output_tokens is a lower bound (content chunks counted)
    requested_max_tokens: int | None = None
    n: int | None = None
    stop_requested: bool = False


@dataclass(frozen=True, slots=True)
class Verdict:
    stop_reason: StopReason
    length_cause: LengthCause | None = None
    certain: bool = True
    upstream_error: UpstreamErrorKind | None = None
    upstream_error_detail: str | None = None


def is_oom(message: str) -> bool:
    """True when an error text says the server ran out of (GPU) memory."""
    return _OOM.search(message) is not None


def finish_stop_reason(dialect: str, finish: Finish) -> StopReason:
    """Map a server's raw finish value to the canonical stop reason."""
    raw = (finish.reason or "").lower()
    if dialect == "ollama":
        return _OLLAMA_DONE.get(raw, "unknown")
    if raw in _LLAMACPP_STOP and raw != "eos":
        return _LLAMACPP_STOP[raw]
    reason = _OPENAI_FINISH.get(raw, "unknown")
    # vLLM names the matched stop string or token id in `stop_reason` (null for EOS);
    # llama.cpp names it in `stopping_word`. Without such a field, "stop" is taken as EOS.
    if reason == "eos" and finish.detail is not None:
        return "stop_sequence"
    return reason


def length_cause(output_tokens: int | None, requested: int | None, n: int | None, *,
                 exact: bool = True) -> LengthCause:
    """`requested_budget` when the length stop came at the client's budget, `server_limit` before it.

    No budget requested means the server's own limit decided (its default, or the context).
    A count that is only a lower bound (content chunks, when the server sent no usage: one chunk
    can carry several tokens, or none that shows as text) proves a stop at the budget when it
    reaches it, but never a stop before it: then the cause is `unknown`, not `server_limit`.
    """
    if requested is None:
        return "server_limit"
    if output_tokens is None:
        return "unknown"
    per_choice = output_tokens / n if n and n > 1 else output_tokens
    if per_choice >= requested:
        return "requested_budget"
    return "server_limit" if exact else "unknown"


def classify(facts: WireFacts) -> Verdict:
    if facts.connect_error is not None:
        return Verdict("upstream_error", upstream_error=facts.connect_error,
                       upstream_error_detail=facts.error_detail)
    if facts.enforced == "total":
        return Verdict("deadline")
    if facts.enforced == "idle":
        return Verdict("idle_timeout")
    if facts.client_disconnected:
        return Verdict("client_disconnect")
    status = facts.status or 0
    if status in (429, 503):
        return Verdict("rejected", upstream_error_detail=_message(facts.error))
    if status >= 400:
        message = _message(facts.error)
        kind: UpstreamErrorKind = "oom" if message and is_oom(message) else "http_status"
        return Verdict("upstream_error", upstream_error=kind,
                       upstream_error_detail=f"HTTP {status}" + (f": {message}" if message else ""))
    if not facts.inference:
        return Verdict("not_inference")
    if facts.error is not None:
        kind = "oom" if is_oom(facts.error.message) else "error_event"
        return Verdict("upstream_error", upstream_error=kind, upstream_error_detail=facts.error.message)
    if facts.upstream_reset:
        return Verdict("upstream_disconnect", upstream_error="reset", upstream_error_detail=facts.error_detail)
    if facts.finish is not None:
        raw = (facts.finish.reason or "").lower()
        if facts.dialect != "ollama" and raw == "abort":
            # vLLM's "abort": the engine dropped the request before it finished.
            return Verdict("upstream_error", upstream_error="abort", upstream_error_detail="finish_reason=abort")
        if facts.dialect != "ollama" and raw == "error":
            # vLLM's "error": a request-level engine failure (e.g. a KV load failure).
            return Verdict("upstream_error", upstream_error="error_event", upstream_error_detail="finish_reason=error")
        reason = finish_stop_reason(facts.dialect, facts.finish)
        if reason == "length":
            cause = length_cause(facts.output_tokens, facts.requested_max_tokens, facts.n,
                                 exact=facts.tokens_exact)
            return Verdict("length", length_cause=cause)
        if reason == "eos" and facts.stop_requested and not facts.finish.distinguishes_stop:
            # llama.cpp's and Ollama's OpenAI output say "stop" for both: EOS is not proven.
            return Verdict("eos", certain=False)
        return Verdict(reason)
    if facts.done or facts.parse_failed:
        return Verdict("unknown")  # ended explicitly, or in bytes we could not read: no cause shown
    return Verdict("upstream_disconnect")


def _message(error: ErrorEvent | None) -> str | None:
    return None if error is None else error.message
