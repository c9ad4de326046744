"""Ollama's native API: `/api/chat` and `/api/generate`, NDJSON lines, streaming unless told not to.

Checked against Ollama's api/types.go (ChatResponse, GenerateResponse, Metrics) and
server/routes.go: `message.content` / `response` per line, `message.thinking` / `thinking` for a
reasoning model's thoughts, `message.tool_calls`; the final `done: true` line carries
`done_reason` (stop, length, load, unload), `eval_count`, `prompt_eval_count` and the
`*_duration` fields in nanoseconds; an error is one `{"error": "..."}` line. Its "stop" covers
EOS and a matched stop string alike. `Stream *bool`: nil means stream.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.record import RequestInfo, StopReason, utf8_text
from proxy.wire.dialects.base import (
    Dialect,
    as_count,
    as_int,
    as_number,
    error_event,
    expect_object,
    out_of_range,
    positive_budget,
    positive_count,
    read_chat_or_prompt,
)
from proxy.wire.events import ONE_REASONING_TOKEN, ONE_TOKEN, AnswerText, Event, Finish, ServerTimings, Usage

ROUTES = ("/api/chat", "/api/generate")
_NS = 1e-9

DONE_REASONS: dict[str, StopReason] = {
    "stop": "eos",
    "length": "length",
    "load": "not_inference",  # a load request (empty prompt) answers at once
    "unload": "not_inference",
}


def _ns(value: Any) -> float | None:
    number = as_number(value)
    return None if number is None else number * _NS


def events(obj: Any) -> list[Event]:
    """Events in one Ollama NDJSON line or non-streaming response."""
    obj = expect_object(obj)
    if "error" in obj:
        return [error_event(obj["error"])]
    found: list[Event] = []
    message = obj.get("message")
    part = message if isinstance(message, dict) else obj
    if part.get("thinking"):
        found.append(ONE_REASONING_TOKEN)
    if part.get("content") or part.get("response") or part.get("tool_calls"):
        found.append(ONE_TOKEN)
    if obj.get("done") is True:
        raw = obj.get("done_reason")
        stop = DONE_REASONS.get(str(raw).lower(), "unknown") if raw is not None else "unknown"
        found.append(Finish(None if raw is None else str(raw), stop, distinguishes_stop=False))
        found.append(Usage(as_count(obj.get("prompt_eval_count")), as_count(obj.get("eval_count")),
                           ignored=out_of_range(obj, "prompt_eval_count", "eval_count")))
        total = _ns(obj.get("total_duration"))
        if total is not None:
            found.append(ServerTimings(total, _ns(obj.get("load_duration")), _ns(obj.get("prompt_eval_duration")),
                                       _ns(obj.get("eval_duration"))))
    return found


def texts(obj: Any) -> list[Event]:
    """The answer's text (`message.content`, `response`) and each tool call's arguments: Ollama sends
    a tool call whole, its `arguments` an object, written here as the JSON it is."""
    if not isinstance(obj, dict):
        return []
    message = obj.get("message")
    part = message if isinstance(message, dict) else obj
    found: list[Event] = []
    text = part.get("content") if isinstance(message, dict) else part.get("response")
    if isinstance(text, str) and text:
        found.append(AnswerText("content", "0", text))
    calls = part.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        written = arguments if isinstance(arguments, str) else orjson.dumps(arguments).decode()
        found.append(AnswerText("arguments", "", written))  # ("": a whole call of its own)
    return found


def read_request(obj: dict[str, Any], info: RequestInfo) -> None:
    model = obj.get("model")
    info.model = utf8_text(model[:200]) if isinstance(model, str) else None
    options = obj.get("options")
    if isinstance(options, dict):
        info.requested_max_tokens = positive_budget(options.get("num_predict"))
        info.num_ctx = positive_count(options, "num_ctx", info)
        info.seed = as_int(options.get("seed"))
        info.temperature = as_number(options.get("temperature"))
        info.stop_requested = bool(options.get("stop"))
    read_chat_or_prompt(obj, info)
    system = obj.get("system")  # /api/generate's own system prompt, rendered with the prompt
    if isinstance(system, str) and system:
        info.all_words = (info.all_words or 0) + len(system.split())
        if info.all_bytes is not None:
            info.all_bytes += len(system.encode("utf-8", "surrogatepass"))


DIALECT = Dialect(name="ollama", routes=ROUTES, read_request=read_request, events=events,
                  token_keys=(b'"content":"', b'"response":"'), reasoning_keys=(b'"thinking":"',),
                  streams_by_default=True, texts=texts)
