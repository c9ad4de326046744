"""Anthropic's Messages API, as vLLM 0.32 writes it (vllm/entrypoints/anthropic/serving.py).

Streaming: `event: NAME` + `data: {...}` per event: message_start (usage.input_tokens),
content_block_start (an empty text block), one content_block_delta per token (text_delta),
content_block_stop, message_delta (stop_reason, stop_sequence, usage.output_tokens),
message_stop. Stop reasons: `max_tokens` for a length stop, `stop_sequence` with the matched
string, else `end_turn`. Errors: `{"type": "error", "error": {"type", "message"}}`; a full
server answers 529 `overloaded_error`, as Anthropic's API does.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from proxy.simulator.engine import SequenceFinish
from proxy.simulator.generation import (
    GenerationRequest,
    WireError,
    message_text,
    optional_bool,
    optional_int,
    stop_strings,
)
from proxy.simulator.sampling import estimate_prompt_tokens

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
TEMPLATE_TOKENS_PER_MESSAGE = 4
OVERLOADED_STATUS = 529
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error", OVERLOADED_STATUS: "overloaded_error"}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    del param
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def parse_request(body: Any, served_model: str) -> GenerationRequest:
    """A /v1/messages body: `max_tokens` is required by the API."""
    if not isinstance(body, dict):
        raise WireError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served_model:
        raise WireError(404, f"The model `{model}` does not exist.")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise WireError(400, "messages: field required and non-empty")
    budget = optional_int(body, "max_tokens", 1)
    if budget is None:
        raise WireError(400, "max_tokens: field required")
    system = body.get("system")
    texts = [message_text(m.get("content")) if isinstance(m, dict) else "" for m in messages]
    if isinstance(system, str) and system:
        texts.insert(0, system)
    prompt_tokens = sum(estimate_prompt_tokens(t) + TEMPLATE_TOKENS_PER_MESSAGE for t in texts) + 1
    return GenerationRequest(
        model=served_model, prompt_text="\n".join(texts), prompt_tokens=prompt_tokens, requested_tokens=budget,
        num_ctx=None, seed=None, stop=stop_strings(body.get("stop_sequences"), "stop_sequences"),
        stream=optional_bool(body, "stream", False))


def stop_reason(finish: SequenceFinish) -> tuple[str, str | None]:
    """vLLM's `_to_anthropic_stop_reason`: length wins, a named stop string, else end_turn."""
    if finish.reason == "length":
        return "max_tokens", None
    if isinstance(finish.stop_reason, str):
        return "stop_sequence", finish.stop_reason
    return "end_turn", None


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class AnthropicStream:
    """Encodes one response as named SSE events, or one message object."""

    content_type = SSE_CONTENT_TYPE

    def __init__(self, model: str, prompt_tokens: int) -> None:
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.message_id = "chatcmpl-" + uuid.uuid4().hex[:16]
        self._started = False

    def begin(self) -> bytes:
        return b""  # the head comes with the first output, as vLLM sends it

    def chunk(self, text: str, finish: SequenceFinish | None) -> bytes:
        del finish
        out = b""
        if not self._started:
            self._started = True
            message: dict[str, Any] = {"id": self.message_id, "type": "message", "role": "assistant", "content": [],
                       "model": self.model, "stop_reason": None, "stop_sequence": None,
                       "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}
            out += _event("message_start", {"type": "message_start", "message": message})
            out += _event("content_block_start", {"type": "content_block_start",
                                                  "content_block": {"type": "text", "text": ""}, "index": 0})
        if text:
            out += _event("content_block_delta", {"type": "content_block_delta",
                                                  "delta": {"type": "text_delta", "text": text}, "index": 0})
        return out

    def end(self, finish: SequenceFinish, timings: dict[str, int]) -> bytes:
        del timings
        reason, sequence = stop_reason(finish)
        return (_event("content_block_stop", {"type": "content_block_stop", "index": 0})
                + _event("message_delta", {"type": "message_delta",
                                           "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                           "usage": {"input_tokens": finish.prompt_tokens,
                                                     "output_tokens": finish.completion_tokens}})
                + _event("message_stop", {"type": "message_stop"}))

    def error(self, message: str, status: int = 500) -> bytes:
        """A mid-stream error, as vLLM sends one: an `error` event, and the stream ends."""
        return _event("error", error_body(status, message))

    def body(self, text: str, finish: SequenceFinish, timings: dict[str, int]) -> dict[str, Any]:
        del timings
        reason, sequence = stop_reason(finish)
        body: dict[str, Any] = {"id": self.message_id, "type": "message", "role": "assistant",
                                "content": [{"type": "text", "text": text}], "model": self.model,
                                "stop_reason": reason}
        if sequence is not None:
            body["stop_sequence"] = sequence
        body["usage"] = {"input_tokens": finish.prompt_tokens, "output_tokens": finish.completion_tokens}
        return body

    @staticmethod
    def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
        return error_body(status, message, param)
