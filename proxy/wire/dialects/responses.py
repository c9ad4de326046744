"""OpenAI's Responses API, `POST /v1/responses`, as vLLM, Ollama, llama.cpp's server and LM Studio serve it.

Streamed events carry `type`: `response.created`, `response.output_text.delta` (`delta`), the
reasoning deltas (`response.reasoning_text.delta`, `response.reasoning_summary_text.delta`),
`response.function_call_arguments.delta`, and a terminal `response.completed`,
`response.incomplete` or `response.failed` whose `response` is the whole response object:
`status`, `incomplete_details.reason` (`max_output_tokens`, `content_filter`), `error`, and
`usage` (`input_tokens`, `output_tokens`, `output_tokens_details.reasoning_tokens`). A stream
may also end with `{"type": "error", "code", "message"}`. A non-streaming answer is the response
object itself. Checked against the openai SDK's types (ResponseStreamEvent, Response) and vLLM
0.32, which ends a budget stop with `response.completed` whose status is `incomplete`
(vllm/entrypoints/openai/responses): the status decides, not the event's name. llama.cpp's server
says `completed` even when `max_output_tokens` or the context ran out, and its response object
has no `incomplete_details` field: its `completed` is not proof of an answer that ended itself.
One delta may carry several tokens, so counted deltas are a lower bound, like chat chunks.
"""

from __future__ import annotations

from typing import Any

from proxy.record import RequestInfo, StopReason
from proxy.wire.dialects.base import (
    Dialect,
    as_count,
    error_event,
    expect_object,
    out_of_range,
    read_common,
    read_messages,
    read_prompt_text,
)
from proxy.wire.events import ONE_REASONING_TOKEN, ONE_TOKEN, AnswerText, ErrorEvent, Event, Finish, Usage

ROUTES = ("/v1/responses",)

_TEXT_DELTAS = frozenset({"response.output_text.delta", "response.function_call_arguments.delta",
                          "response.custom_tool_call_input.delta", "response.refusal.delta"})
_REASONING_DELTAS = frozenset({"response.reasoning_text.delta", "response.reasoning_summary_text.delta"})
_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
INCOMPLETE: dict[str, StopReason] = {"max_output_tokens": "length", "content_filter": "content_filter"}
_TOOL_ITEMS = frozenset({"function_call", "custom_tool_call", "mcp_call", "computer_call"})


def _terminal(response: dict[str, Any]) -> list[Event]:
    """What a finished response object says: its finish (or its error) and its usage."""
    found: list[Event] = []
    status = response.get("status")
    if status == "failed":
        found.append(error_event(response.get("error") or "response.failed without an error"))
    elif status == "completed":
        output = response.get("output")
        tools = isinstance(output, list) and any(isinstance(i, dict) and i.get("type") in _TOOL_ITEMS
                                                 for i in output)
        # A server that can report an incomplete answer sends `incomplete_details` (null here).
        # llama.cpp's omits the field and says "completed" for a spent budget and a full context
        # too (tools/server/server-task.cpp, to_json_oaicompat_resp): then it proves nothing.
        blind = "incomplete_details" not in response
        found.append(Finish("completed", "tool_calls" if tools else "eos", limit_blind=blind))
    elif status == "incomplete":
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        found.append(Finish(f"incomplete:{reason}", INCOMPLETE.get(str(reason), "unknown")))
    elif isinstance(status, str) and status not in ("queued", "in_progress"):
        found.append(Finish(status, "unknown"))  # cancelled, or a status added later
    usage = response.get("usage")
    if isinstance(usage, dict):
        details = usage.get("output_tokens_details")
        reasoning = as_count(details.get("reasoning_tokens")) if isinstance(details, dict) else None
        ignored = out_of_range(usage, "input_tokens", "output_tokens")
        found.append(Usage(as_count(usage.get("input_tokens")), as_count(usage.get("output_tokens")), reasoning,
                           ignored))
    return found


def events(obj: Any) -> list[Event]:
    obj = expect_object(obj)
    kind = obj.get("type")
    if kind in _TEXT_DELTAS:
        return [ONE_TOKEN] if obj.get("delta") else []
    if kind in _REASONING_DELTAS:
        return [ONE_REASONING_TOKEN] if obj.get("delta") else []
    if kind in _TERMINAL:
        response = obj.get("response")
        return _terminal(response) if isinstance(response, dict) else []
    if kind == "error":  # {"type": "error", "code", "message"}: the code says what went wrong
        return [ErrorEvent(str(obj.get("message"))[:500], None if obj.get("code") is None else str(obj["code"]))]
    if kind is None and obj.get("object") == "response":
        return _terminal(obj)  # a non-streaming answer
    if kind is None and "error" in obj:
        return [error_event(obj["error"])]  # an HTTP error body
    return []


def texts(obj: Any) -> list[Event]:
    """A stream's text and argument deltas (a call keyed by its item, else its output index), or a
    whole response's message text and each function call's `arguments`."""
    if not isinstance(obj, dict):
        return []
    kind = obj.get("type")
    delta = obj.get("delta")
    if kind == "response.output_text.delta" and isinstance(delta, str):
        return [AnswerText("content", "0", delta)]
    if kind in ("response.function_call_arguments.delta", "response.custom_tool_call_input.delta"):
        key = str(obj.get("item_id") or obj.get("output_index"))
        return [AnswerText("arguments", key, delta if isinstance(delta, str) else "")]
    if kind is None and obj.get("object") == "response":
        found: list[Event] = []
        for position, item in enumerate(obj.get("output") or ()):
            if not isinstance(item, dict):
                continue
            if item.get("type") == "function_call":
                arguments = item.get("arguments")
                found.append(AnswerText("arguments", str(item.get("id") or position),
                                        arguments if isinstance(arguments, str) else ""))
            for part in item.get("content") or () if item.get("type") == "message" else ():
                if isinstance(part, dict) and part.get("type") == "output_text" and isinstance(part.get("text"), str):
                    found.append(AnswerText("content", "0", part["text"]))
        return found
    return []


def read_request(obj: dict[str, Any], info: RequestInfo) -> None:
    read_common(obj, info, budget_fields=("max_output_tokens",))
    given = obj.get("input")
    if isinstance(given, list):  # items: messages with a role, tool outputs (not counted), ...
        read_messages([item for item in given if isinstance(item, dict) and "role" in item], info)
        info.has_prompt = bool(given)
    else:
        read_prompt_text(given, info)


DIALECT = Dialect(name="responses", routes=ROUTES, read_request=read_request, events=events,
                  token_keys=(b'"delta":"',), reasoning_keys=(b'"delta":"',), provider="openai", texts=texts)
