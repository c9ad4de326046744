"""What the dialects mean: JSON objects of OpenAI-compatible, Ollama and llama.cpp servers -> events.

Field meanings checked against the servers' sources:
- OpenAI-compatible chunks: `choices[].delta.content` / `choices[].text`, `finish_reason`;
  vLLM adds `stop_reason` (the stop string or token id that matched; null for EOS) and sends
  errors mid-stream as `data: {"error": {...}}` (older versions: `{"object": "error", ...}`).
- Ollama (api/types.go): `message.content` or `response`, `done`, `done_reason`,
  `eval_count`, `prompt_eval_count`, `*_duration` in nanoseconds, `{"error": "..."}` lines.
- llama.cpp's native /completion (tools/server): `content`, `stop`, `stop_type`
  (`eos`, `word`, `limit`), `stopping_word`, `truncated`, `tokens_predicted`,
  `tokens_evaluated`, `timings` (ms).
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.events import (
    ONE_TOKEN,
    ErrorEvent,
    Event,
    Finish,
    ServerTimings,
    TokenDelta,
    Usage,
)
from proxy.record import RequestInfo

_NS = 1e-9
_MS = 1e-3


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _num(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _error_event(error: Any) -> ErrorEvent:
    if isinstance(error, dict):
        message = error.get("message")
        kind = error.get("type") or error.get("code")
        return ErrorEvent(str(message if message is not None else error)[:500], None if kind is None else str(kind))
    return ErrorEvent(str(error)[:500])


def openai_events(obj: Any) -> list[Event]:
    """Events in one OpenAI-compatible chunk or complete response (chat or completions)."""
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    if "error" in obj:
        return [_error_event(obj["error"])]
    if obj.get("object") == "error":
        return [_error_event(obj)]
    events: list[Event] = []
    choices = obj.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"):
                    events.append(ONE_TOKEN)
            elif choice.get("text"):
                events.append(ONE_TOKEN)
            reason = choice.get("finish_reason")
            if reason is not None:
                detail = choice.get("stop_reason")
                events.append(Finish(str(reason), _int(choice.get("index")) or 0,
                                     None if detail is None else str(detail),
                                     distinguishes_stop="stop_reason" in choice))
    usage = obj.get("usage")
    if isinstance(usage, dict):
        events.append(Usage(_int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens"))))
    if "stop" in obj and "choices" not in obj:
        events.extend(llamacpp_events(obj))
    elif isinstance(obj.get("timings"), dict):
        # llama-server's OpenAI routes put its timings on the finish chunk, with `predicted_n`:
        # the server's own count of generated tokens, exact where content chunks only bound it.
        timings = obj["timings"]
        events.append(_llamacpp_timings(timings))
        predicted = _int(timings.get("predicted_n"))
        if predicted is not None and not isinstance(usage, dict):
            events.append(Usage(None, predicted))
    return events


def llamacpp_events(obj: dict[str, Any]) -> list[Event]:
    """Events in one object of llama.cpp's native `/completion` endpoint."""
    events: list[Event] = []
    if obj.get("content"):
        events.append(ONE_TOKEN)
    if obj.get("stop") is True:
        stop_type = obj.get("stop_type")
        word = obj.get("stopping_word")
        truncated = obj.get("truncated")
        events.append(Finish(None if stop_type is None else str(stop_type), 0, str(word) if word else None,
                             truncated if isinstance(truncated, bool) else None))
        predicted = _int(obj.get("tokens_predicted"))
        evaluated = _int(obj.get("tokens_evaluated"))
        if predicted is not None or evaluated is not None:
            events.append(Usage(evaluated, predicted))
        if isinstance(obj.get("timings"), dict):
            events.append(_llamacpp_timings(obj["timings"]))
    return events


def _llamacpp_timings(timings: dict[str, Any]) -> ServerTimings:
    prompt_ms = _num(timings.get("prompt_ms"))
    predicted_ms = _num(timings.get("predicted_ms"))
    return ServerTimings(prompt_eval_s=None if prompt_ms is None else prompt_ms * _MS,
                         eval_s=None if predicted_ms is None else predicted_ms * _MS)


def ollama_events(obj: Any) -> list[Event]:
    """Events in one Ollama NDJSON line or non-streaming response (`/api/chat`, `/api/generate`)."""
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    if "error" in obj:
        return [_error_event(obj["error"])]
    message = obj.get("message")
    if isinstance(message, dict):
        if message.get("content") or message.get("thinking") or message.get("tool_calls"):
            events: list[Event] = [ONE_TOKEN]
        else:
            events = []
    elif obj.get("response") or obj.get("thinking"):
        events = [ONE_TOKEN]
    else:
        events = []
    if obj.get("done") is True:
        reason = obj.get("done_reason")
        # Ollama says "stop" for EOS and for a matched stop string alike.
        events.append(Finish(None if reason is None else str(reason), distinguishes_stop=False))
        events.append(Usage(_int(obj.get("prompt_eval_count")), _int(obj.get("eval_count"))))
        total, load = _num(obj.get("total_duration")), _num(obj.get("load_duration"))
        prompt, evaluation = _num(obj.get("prompt_eval_duration")), _num(obj.get("eval_duration"))
        if total is not None:
            events.append(ServerTimings(
                total * _NS, None if load is None else load * _NS,
                None if prompt is None else prompt * _NS, None if evaluation is None else evaluation * _NS))
    return events


def is_token(event: Event) -> bool:
    return isinstance(event, TokenDelta)


# --- requests --------------------------------------------------------------------------------

def parse_request(dialect: str, body: bytes) -> RequestInfo:
    """What a generation request asks for; never raises (a body it cannot read is noted)."""
    info = RequestInfo()
    if not body:
        info.body_note = "empty body"
        return info
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        info.body_note = "request body is not JSON"
        return info
    if not isinstance(obj, dict):
        info.body_note = "request body is not a JSON object"
        return info
    info.body_parsed = True
    model = obj.get("model")
    info.model = model[:200] if isinstance(model, str) else None
    stream = obj.get("stream")
    if dialect == "ollama":
        # Ollama streams unless told otherwise (api/types.go: Stream *bool, nil means true).
        info.stream = stream if isinstance(stream, bool) else True
        options = obj.get("options")
        if isinstance(options, dict):
            info.requested_max_tokens = _positive_budget(options.get("num_predict"))
            info.num_ctx = _int(options.get("num_ctx"))
            info.seed = _int(options.get("seed"))
            info.temperature = _num(options.get("temperature"))
            info.stop_requested = bool(options.get("stop"))
    else:
        info.stream = stream if isinstance(stream, bool) else False
        info.stop_requested = bool(obj.get("stop"))
        budget = obj.get("max_completion_tokens", obj.get("max_tokens"))
        if dialect == "llamacpp" and budget is None:
            budget = obj.get("n_predict")
        info.requested_max_tokens = _positive_budget(budget)
        info.seed = _int(obj.get("seed"))
        info.temperature = _num(obj.get("temperature"))
        info.n = _int(obj.get("n"))
    return info


def _positive_budget(value: Any) -> int | None:
    """A budget in tokens; Ollama's -1 (infinite) and -2 (fill context) mean no fixed budget."""
    number = _int(value)
    return number if number is not None and number > 0 else None
