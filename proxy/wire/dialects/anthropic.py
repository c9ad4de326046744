"""Anthropic's Messages API, `POST /v1/messages`, as Ollama (0.14+), llama.cpp's server and vLLM serve it.

Streaming is SSE with named events whose data carries the same `type` (the name is not needed):
`message_start` (`message.usage.input_tokens`), `content_block_start`, `content_block_delta`
(`text_delta`, `thinking_delta`, `input_json_delta`, `signature_delta`), `content_block_stop`,
`message_delta` (`delta.stop_reason`, `delta.stop_sequence`, cumulative `usage.output_tokens`),
`message_stop`, `ping` and `error` (`{"type": "error", "error": {"type": ..., "message": ...}}`,
HTTP 529 for `overloaded_error` on Anthropic's own API). A non-streaming answer is one
`{"type": "message", ...}` with `stop_reason`, `stop_sequence` and `usage`. Checked against the
anthropic SDK's types (MessageStreamEvent, StopReason) and the servers: llama.cpp says `end_turn`
for EOS and a stop word alike but names the word in `stop_sequence`
(tools/server/server-task.cpp, to_json_anthropic); vLLM 0.32 maps its finish reasons onto these.
`/v1/messages/count_tokens` is not a generation: it is not a route of this dialect.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.record import RequestInfo, StopReason, utf8_text
from proxy.wire.dialects.base import (
    Dialect,
    as_count,
    as_number,
    error_event,
    expect_object,
    out_of_range,
    positive_budget,
    read_messages,
)
from proxy.wire.events import DONE, ONE_REASONING_TOKEN, ONE_TOKEN, AnswerText, Event, Finish, Usage

ROUTES = ("/v1/messages",)
OVERLOADED = frozenset({"overloaded_error"})

STOP_REASONS: dict[str, StopReason] = {
    "end_turn": "eos",
    "stop_sequence": "stop_sequence",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    # The turn ended so that the client continues it (a long server-tool loop): like a tool call.
    "pause_turn": "tool_calls",
    "refusal": "content_filter",
    "model_context_window_exceeded": "length",
}
_TOKEN_DELTAS = frozenset({"text_delta", "input_json_delta"})


def finish(raw: str, sequence: Any) -> Finish:
    stop = STOP_REASONS.get(raw, "unknown")
    detail = str(sequence) if sequence else None
    if stop == "eos" and detail is not None:
        stop = "stop_sequence"  # llama.cpp: end_turn, with the stop word it matched named
    return Finish(raw, stop, 0, detail, context_limit=raw == "model_context_window_exceeded")


def _usage(usage: Any, *, output: bool) -> Usage | None:
    """Anthropic's usage: the prompt is input plus cached input (counted apart), the output is cumulative."""
    if not isinstance(usage, dict):
        return None
    names = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    parts = [as_count(usage.get(k)) for k in names]
    prompt = sum(p for p in parts if p is not None) if parts[0] is not None else None
    ignored = out_of_range(usage, *names, *(("output_tokens",) if output else ()))
    return Usage(prompt, as_count(usage.get("output_tokens")) if output else None, ignored=ignored)


def events(obj: Any) -> list[Event]:
    """Events in one streamed event's data, or in a whole non-streaming message."""
    obj = expect_object(obj)
    kind = obj.get("type")
    if kind == "content_block_delta":
        delta = obj.get("delta")
        if not isinstance(delta, dict):
            return []
        delta_type = delta.get("type")
        if delta_type in _TOKEN_DELTAS:
            return [ONE_TOKEN] if (delta.get("text") or delta.get("partial_json")) else []
        if delta_type == "thinking_delta":
            return [ONE_REASONING_TOKEN] if delta.get("thinking") else []
        return []
    if kind == "message_delta":
        found: list[Event] = []
        delta = obj.get("delta")
        if isinstance(delta, dict) and delta.get("stop_reason") is not None:
            found.append(finish(str(delta["stop_reason"]), delta.get("stop_sequence")))
        usage = _usage(obj.get("usage"), output=True)
        if usage is not None:
            found.append(usage)
        return found
    if kind == "message_start":
        message = obj.get("message")
        usage = _usage(message.get("usage"), output=False) if isinstance(message, dict) else None
        return [usage] if usage is not None else []
    if kind == "content_block_start":
        block = obj.get("content_block")
        if isinstance(block, dict) and (block.get("text") or block.get("thinking")):
            return [ONE_REASONING_TOKEN if block.get("thinking") else ONE_TOKEN]
        return []
    if kind == "message_stop":
        return [DONE]
    if kind == "error" or "error" in obj:
        return [error_event(obj.get("error"), overloaded_types=OVERLOADED)]
    if kind == "message":
        found = []
        if obj.get("stop_reason") is not None:
            found.append(finish(str(obj["stop_reason"]), obj.get("stop_sequence")))
        usage = _usage(obj.get("usage"), output=True)
        if usage is not None:
            found.append(usage)
        return found
    return []  # ping, content_block_stop, and event types added later


def texts(obj: Any) -> list[Event]:
    """A stream's text and `input_json_delta` pieces (a tool use keyed by its block's index, begun
    by its `content_block_start`), or a whole message's text and each tool use's `input`."""
    if not isinstance(obj, dict):
        return []
    kind = obj.get("type")
    if kind == "content_block_start":
        block = obj.get("content_block")
        if isinstance(block, dict) and block.get("type") in ("tool_use", "server_tool_use"):
            return [AnswerText("arguments", str(obj.get("index")), "")]
        return []
    if kind == "content_block_delta":
        delta = obj.get("delta")
        if not isinstance(delta, dict):
            return []
        if delta.get("type") == "text_delta" and isinstance(delta.get("text"), str):
            return [AnswerText("content", "0", delta["text"])]
        if delta.get("type") == "input_json_delta" and isinstance(delta.get("partial_json"), str):
            return [AnswerText("arguments", str(obj.get("index")), delta["partial_json"])]
        return []
    if kind == "message":
        found: list[Event] = []
        for position, block in enumerate(obj.get("content") or ()):
            if not isinstance(block, dict):
                continue
            if block.get("type") == "text" and isinstance(block.get("text"), str):
                found.append(AnswerText("content", "0", block["text"]))
            elif block.get("type") in ("tool_use", "server_tool_use"):
                found.append(AnswerText("arguments", str(position), orjson.dumps(block.get("input")).decode()))
        return found
    return []


def read_request(obj: dict[str, Any], info: RequestInfo) -> None:
    model = obj.get("model")
    info.model = utf8_text(model[:200]) if isinstance(model, str) else None
    info.requested_max_tokens = positive_budget(obj.get("max_tokens"))
    info.temperature = as_number(obj.get("temperature"))
    info.stop_requested = bool(obj.get("stop_sequences"))
    thinking = obj.get("thinking")
    if isinstance(thinking, dict):
        info.reasoning_budget = positive_budget(thinking.get("budget_tokens"))
    read_messages(obj.get("messages"), info)  # `system` is apart from the turns, and not counted
    info.tools = bool(obj.get("tools"))


DIALECT = Dialect(name="anthropic", routes=ROUTES, read_request=read_request, events=events,
                  token_keys=(b'"text":"',), reasoning_keys=(b'"thinking":"',), texts=texts)
