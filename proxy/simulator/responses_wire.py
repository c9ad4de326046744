"""OpenAI's Responses API, as vLLM 0.32 writes it (vllm/entrypoints/openai/responses).

Streaming: `event: NAME` + `data: {...}` with a `sequence_number`: response.created,
response.in_progress, response.output_item.added, response.content_part.added, one
response.output_text.delta per output, response.output_text.done, response.content_part.done,
response.output_item.done, and response.completed, whose response's status is `completed`, or
`incomplete` with `incomplete_details.reason: max_output_tokens` for a length stop (vLLM sends
response.completed for both). A non-streaming answer is that response object.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from proxy.simulator.engine import SequenceFinish
from proxy.simulator.generation import GenerationRequest, WireError, message_text, optional_bool, optional_int
from proxy.simulator.openai_wire import error_body as openai_error_body
from proxy.simulator.sampling import estimate_prompt_tokens

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
TEMPLATE_TOKENS = 6


def parse_request(body: Any, served_model: str) -> GenerationRequest:
    """A /v1/responses body: `input` is a string or a list of messages."""
    if not isinstance(body, dict):
        raise WireError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served_model:
        raise WireError(404, f"The model `{model}` does not exist.", "model")
    given = body.get("input")
    if isinstance(given, str):
        text = given
    elif isinstance(given, list):
        text = "\n".join(message_text(m.get("content")) if isinstance(m, dict) else "" for m in given)
    else:
        raise WireError(400, "input must be a string or a list of messages", "input")
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        text = f"{instructions}\n{text}"
    return GenerationRequest(
        model=served_model, prompt_text=text, prompt_tokens=estimate_prompt_tokens(text) + TEMPLATE_TOKENS,
        requested_tokens=optional_int(body, "max_output_tokens", 1), num_ctx=None, seed=optional_int(body, "seed"),
        stop=(), stream=optional_bool(body, "stream", False))


class ResponsesStream:
    """Encodes one response as Responses events, or one response object."""

    content_type = SSE_CONTENT_TYPE

    def __init__(self, model: str, max_output_tokens: int | None) -> None:
        self.model = model
        self.max_output_tokens = max_output_tokens
        self.response_id = "resp_" + uuid.uuid4().hex[:16]
        self.item_id = "msg_" + uuid.uuid4().hex[:16]
        self.created = int(time.time())
        self._sequence = 0
        self._started = False
        self._text: list[str] = []

    def _event(self, name: str, data: dict[str, Any]) -> bytes:
        data["sequence_number"] = self._sequence
        data["type"] = name
        self._sequence += 1
        return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def _response(self, status: str, finish: SequenceFinish | None, text: str | None) -> dict[str, Any]:
        output = [] if text is None else [{
            "id": self.item_id, "content": [{"annotations": [], "text": text, "type": "output_text",
                                             "logprobs": None}],
            "role": "assistant", "status": "completed", "type": "message"}]
        usage = None if finish is None else {
            "input_tokens": finish.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": finish.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": finish.prompt_tokens + finish.completion_tokens}
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.response_id, "created_at": self.created, "incomplete_details": incomplete,
                "instructions": None, "metadata": None, "model": self.model, "object": "response",
                "output": output, "parallel_tool_calls": True, "temperature": 1.0, "tool_choice": "none",
                "tools": [], "top_p": 1.0, "background": False, "max_output_tokens": self.max_output_tokens,
                "status": status, "usage": usage}

    def begin(self) -> bytes:
        return b""

    def chunk(self, text: str, finish: SequenceFinish | None) -> bytes:
        del finish
        out = b""
        if not self._started:
            self._started = True
            out += self._event("response.created", {"response": self._response("in_progress", None, None)})
            out += self._event("response.in_progress", {"response": self._response("in_progress", None, None)})
            out += self._event("response.output_item.added", {"item": {
                "id": self.item_id, "content": [], "role": "assistant", "status": "in_progress", "type": "message"},
                "output_index": 0})
            out += self._event("response.content_part.added", {
                "content_index": 0, "item_id": self.item_id, "output_index": 0,
                "part": {"annotations": [], "text": "", "type": "output_text", "logprobs": []}})
        if text:
            self._text.append(text)
            out += self._event("response.output_text.delta", {
                "content_index": 0, "delta": text, "item_id": self.item_id, "logprobs": [], "output_index": 0})
        return out

    def end(self, finish: SequenceFinish, timings: dict[str, int]) -> bytes:
        del timings
        text = "".join(self._text)
        status = "incomplete" if finish.reason == "length" else "completed"
        part: dict[str, Any] = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
        return (self._event("response.output_text.done", {"content_index": 0, "item_id": self.item_id,
                                                          "logprobs": [], "output_index": 0, "text": text})
                + self._event("response.content_part.done", {"content_index": 0, "item_id": self.item_id,
                                                             "output_index": 0, "part": part})
                + self._event("response.output_item.done", {"item": {
                    "id": self.item_id, "content": [part], "role": "assistant", "status": "completed",
                    "type": "message"}, "output_index": 0})
                + self._event("response.completed", {"response": self._response(status, finish, text)}))

    def error(self, message: str, status: int = 500) -> bytes:
        return self._event("error", {"code": str(status), "message": message, "param": None})

    def body(self, text: str, finish: SequenceFinish, timings: dict[str, int]) -> dict[str, Any]:
        del timings
        return self._response("incomplete" if finish.reason == "length" else "completed", finish, text)

    @staticmethod
    def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
        return openai_error_body(status, message, param)
