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
  generated tokens, and `prompt_n` + `cache_n`, the prompt's (processed and cached), even when no
  usage chunk was asked for (tools/server/server-task.cpp, server-common.cpp); its plain "stop"
  covers EOS and a stop word alike (no `stop_reason` field);
- SGLang names what ended a "stop" in `matched_stop` on every choice: the stop string matched, or
  the token id (EOS, or one of the client's `stop_token_ids`), null otherwise
  (python/sglang/srt/entrypoints/openai/protocol.py, serving_chat.py);
- Ollama's `/v1` streams thinking as `delta.reasoning`, and a whole answer's as `message.reasoning`
  (openai/openai.go).
"""

from __future__ import annotations

from typing import Any

from proxy.record import RequestInfo, StopReason, UpstreamErrorKind
from proxy.wire.dialects.base import (
    Dialect,
    as_count,
    as_number,
    error_event,
    expect_object,
    out_of_range,
    positive_count,
    read_chat_or_prompt,
    read_common,
)
from proxy.wire.events import ONE_REASONING_TOKEN, ONE_TOKEN, AnswerText, Event, Finish, ServerTimings, Usage

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


def finish(raw: str, choice: int, detail: Any, distinguishes_stop: bool, matched_token: int | None = None) -> Finish:
    """A `finish_reason` with vLLM's `stop_reason` or SGLang's string `matched_stop` (`detail`: the
    stop sequence that matched) and SGLang's token `matched_stop`, read by the table above."""
    key = raw.lower()
    stop = FINISH.get(key, "unknown")
    named = None if detail is None else str(detail)
    if stop == "eos" and named is not None:
        stop = "stop_sequence"  # vLLM names the matched stop string or token id; null for EOS
    error: UpstreamErrorKind | None = "abort" if key == "abort" else "error_event" if key == "error" else None
    return Finish(raw, stop, choice, named, distinguishes_stop=distinguishes_stop, upstream_error=error,
                  matched_token=matched_token)


def _finish_of(choice: dict[str, Any], reason: Any) -> Finish:
    index = as_count(choice.get("index")) or 0
    if "matched_stop" in choice:  # SGLang: a string is a stop sequence, a token id EOS or a stop token
        matched = choice.get("matched_stop")
        token = as_count(matched)
        return finish(str(reason), index, matched if isinstance(matched, str) else None, True, token)
    return finish(str(reason), index, choice.get("stop_reason"), "stop_reason" in choice)


def timings_of(timings: dict[str, Any]) -> ServerTimings:
    """llama.cpp's `timings` (milliseconds)."""
    prompt_ms = as_number(timings.get("prompt_ms"))
    predicted_ms = as_number(timings.get("predicted_ms"))
    return ServerTimings(prompt_eval_s=None if prompt_ms is None else prompt_ms * _MS,
                         eval_s=None if predicted_ms is None else predicted_ms * _MS)


def metrics_of(metrics: dict[str, Any]) -> ServerTimings:
    """vLLM's per-request `metrics` (`--enable-per-request-metrics`; milliseconds; vllm/entrypoints/
    generate/base/serving.py, build_per_request_timing_metrics): queued, scheduled to first token
    (the prefill), first to last token (the decode)."""
    queue, prefill, decode = (as_number(metrics.get(key)) for key in
                              ("queue_time_ms", "time_to_first_token_ms", "generation_time_ms"))
    return ServerTimings(prompt_eval_s=None if prefill is None else prefill * _MS,
                         eval_s=None if decode is None else decode * _MS,
                         queue_s=None if queue is None else queue * _MS, source="server_metrics")


def usage_of(usage: dict[str, Any]) -> Usage:
    details = usage.get("completion_tokens_details")
    reasoning = as_count(details.get("reasoning_tokens")) if isinstance(details, dict) else None
    ignored = out_of_range(usage, "prompt_tokens", "completion_tokens")
    if isinstance(details, dict):
        ignored += out_of_range(details, "reasoning_tokens")
    return Usage(as_count(usage.get("prompt_tokens")), as_count(usage.get("completion_tokens")), reasoning, ignored)


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
            part = choice.get("delta")
            if not isinstance(part, dict):
                part = choice.get("message")  # a whole answer: what it showed, counted once each
            if isinstance(part, dict):
                if part.get("reasoning") or part.get("reasoning_content"):
                    found.append(ONE_REASONING_TOKEN)
                if part.get("content") or part.get("tool_calls"):
                    found.append(ONE_TOKEN)
            elif choice.get("text"):
                found.append(ONE_TOKEN)
            reason = choice.get("finish_reason")
            if reason is not None:
                found.append(_finish_of(choice, reason))
    usage = obj.get("usage")
    if isinstance(usage, dict):
        found.append(usage_of(usage))
    timings = obj.get("timings")
    if isinstance(timings, dict):
        found.append(timings_of(timings))
        if not isinstance(usage, dict):
            found.append(timings_usage(timings))
    metrics = obj.get("metrics")
    if isinstance(metrics, dict):
        found.append(metrics_of(metrics))
    return found


def timings_usage(timings: dict[str, Any]) -> Usage:
    """llama.cpp's own counts in `timings`: the prompt (processed plus cached) and the generated tokens."""
    processed, cached = as_count(timings.get("prompt_n")), as_count(timings.get("cache_n"))
    prompt = processed + (cached or 0) if processed is not None else None
    return Usage(prompt, as_count(timings.get("predicted_n")),
                 ignored=out_of_range(timings, "prompt_n", "cache_n", "predicted_n"))


def texts(obj: Any) -> list[Event]:
    """The visible content and each tool call's arguments, of a chunk or a whole answer (chat or
    completions); a tool call is keyed by its choice and its `index` (the legacy `function_call` by its
    choice alone)."""
    found: list[Event] = []
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list):
        return found
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        number = as_count(choice.get("index")) or 0
        part = choice.get("delta")
        if not isinstance(part, dict):
            part = choice.get("message")
        if not isinstance(part, dict):
            if isinstance(choice.get("text"), str) and choice["text"]:
                found.append(AnswerText("content", str(number), choice["text"]))
            continue
        if isinstance(part.get("content"), str) and part["content"]:
            found.append(AnswerText("content", str(number), part["content"]))
        calls = part.get("tool_calls")
        for position, call in enumerate(calls if isinstance(calls, list) else ()):
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            key = f"{number}:{as_count(call.get('index')) if as_count(call.get('index')) is not None else position}"
            found.append(AnswerText("arguments", key, arguments if isinstance(arguments, str) else ""))
        legacy = part.get("function_call")
        if isinstance(legacy, dict):
            arguments = legacy.get("arguments")
            found.append(AnswerText("arguments", f"{number}:function_call", arguments if isinstance(arguments, str)
                                    else ""))
    return found


def read_request(obj: dict[str, Any], info: RequestInfo) -> None:
    read_common(obj, info, budget_fields=("max_completion_tokens", "max_tokens"))
    info.stop_requested = bool(obj.get("stop"))
    info.n = positive_count(obj, "n", info)
    stop_ids = obj.get("stop_token_ids")
    if isinstance(stop_ids, list):
        info.stop_token_ids = tuple(i for i in stop_ids[:256] if as_count(i) is not None)
    # vLLM: -1 keeps as many as the context takes (vllm/entrypoints/openai/protocol.py)
    info.truncate_prompt_tokens = positive_count(obj, "truncate_prompt_tokens", info, allowed=(-1,))
    read_chat_or_prompt(obj, info)


DIALECT = Dialect(name="openai", routes=ROUTES, read_request=read_request, events=events,
                  token_keys=(b'"content":"', b'"text":"'),
                  reasoning_keys=(b'"reasoning":"', b'"reasoning_content":"'), texts=texts)
