"""OpenAI chat/completions, as vLLM, Ollama's `/v1`, llama.cpp, SGLang and LM Studio serve it.

Checked against the servers' sources:
- chunks carry `choices[].delta.content` (chat) or `choices[].text` (completions) and
  `finish_reason` per choice; vLLM adds `stop_reason`: the stop string or token id that
  matched, null for EOS (vllm/entrypoints/openai/chat_completion/serving.py);
- reasoning arrives in `delta.reasoning` (vLLM 0.32) or `delta.reasoning_content` (older vLLM,
  llama.cpp, SGLang), and its count in `usage.completion_tokens_details.reasoning_tokens`;
- vLLM's finish reasons are stop, length, abort, error and repetition
  (vllm/v1/engine/__init__.py, FINISH_REASON_STRINGS); `abort` is the engine dropping the
  request, `error` a request-level failure, `repetition` its `repetition_detection` cutting a
  repeating answer;
- errors come mid-stream as `data: {"error": {...}}` (older vLLM: `{"object": "error", ...}`);
- llama-server puts `timings` on the finish chunk, with `predicted_n`, its own count of the
  generated tokens, even when no usage chunk was asked for (tools/server/server-task.cpp);
  its plain "stop" covers EOS and a stop word alike (no `stop_reason` field).
"""

from __future__ import annotations

from typing import Any

from proxy.dialects.base import Dialect, as_int, as_number, error_event, expect_object, read_common
from proxy.events import ONE_REASONING_TOKEN, ONE_TOKEN, Event, Finish, ServerTimings, Usage
from proxy.record import RequestInfo, StopReason, UpstreamErrorKind

ROUTES = ("/v1/chat/completions", "/v1/completions", "/chat/completions")
_MS = 1e-3

FINISH: dict[str, StopReason] = {
    "stop": "eos",
    "eos": "eos",
    "length": "length",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
    "content_filter": "content_filter",
    "repetition": "repetition",
    "abort": "upstream_error",
    "error": "upstream_error",
}


def finish(raw: str, choice: int, detail: Any, distinguishes_stop: bool) -> Finish:
    """A `finish_reason` with vLLM's `stop_reason` (`detail`), read by the table above."""
    key = raw.lower()
    stop = FINISH.get(key, "unknown")
    named = None if detail is None else str(detail)
    if stop == "eos" and named is not None:
        stop = "stop_sequence"  # vLLM names the matched stop string or token id; null for EOS
    error: UpstreamErrorKind | None = "abort" if key == "abort" else "error_event" if key == "error" else None
    return Finish(raw, stop, choice, named, distinguishes_stop=distinguishes_stop, upstream_error=error)


def timings_of(timings: dict[str, Any]) -> ServerTimings:
    """llama.cpp's `timings` (milliseconds)."""
    prompt_ms = as_number(timings.get("prompt_ms"))
    predicted_ms = as_number(timings.get("predicted_ms"))
    return ServerTimings(prompt_eval_s=None if prompt_ms is None else prompt_ms * _MS,
                         eval_s=None if predicted_ms is None else predicted_ms * _MS)


def usage_of(usage: dict[str, Any]) -> Usage:
    details = usage.get("completion_tokens_details")
    reasoning = as_int(details.get("reasoning_tokens")) if isinstance(details, dict) else None
    return Usage(as_int(usage.get("prompt_tokens")), as_int(usage.get("completion_tokens")), reasoning)


def events(obj: Any) -> list[Event]:
    """Events in one OpenAI-compatible chunk or complete response (chat or completions)."""
    obj = expect_object(obj)
    if "error" in obj:
        return [error_event(obj["error"])]
    if obj.get("object") == "error":
        return [error_event(obj)]
    found: list[Event] = []
    choices = obj.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if delta.get("reasoning") or delta.get("reasoning_content"):
                    found.append(ONE_REASONING_TOKEN)
                if delta.get("content") or delta.get("tool_calls"):
                    found.append(ONE_TOKEN)
            elif choice.get("text"):
                found.append(ONE_TOKEN)
            reason = choice.get("finish_reason")
            if reason is not None:
                found.append(finish(str(reason), as_int(choice.get("index")) or 0, choice.get("stop_reason"),
                                    "stop_reason" in choice))
    usage = obj.get("usage")
    if isinstance(usage, dict):
        found.append(usage_of(usage))
    timings = obj.get("timings")
    if isinstance(timings, dict):
        found.append(timings_of(timings))
        predicted = as_int(timings.get("predicted_n"))
        if predicted is not None and not isinstance(usage, dict):
            found.append(Usage(None, predicted))
    return found


def read_request(obj: dict[str, Any], info: RequestInfo) -> None:
    read_common(obj, info, budget_fields=("max_completion_tokens", "max_tokens"))
    info.stop_requested = bool(obj.get("stop"))
    info.n = as_int(obj.get("n"))


DIALECT = Dialect(name="openai", routes=ROUTES, read_request=read_request, events=events,
                  token_keys=(b'"content":"', b'"text":"'),
                  reasoning_keys=(b'"reasoning":"', b'"reasoning_content":"'))
