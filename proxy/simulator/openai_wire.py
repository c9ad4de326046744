"""The OpenAI-compatible wire format, as vLLM writes it.

Chunk shapes follow vLLM's `chat_completion_stream_generator` and `completion_stream_generator`
(vllm/entrypoints/openai/chat_completion/serving.py, completion/serving.py): a role chunk
first (chat), one chunk per token with `logprobs`/`finish_reason` present as null, the last
token's text riding in the chunk that carries `finish_reason` and vLLM's `stop_reason`, then
a `choices: []` usage chunk when `stream_options.include_usage` is true, then `data: [DONE]`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

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

Kind = Literal["chat", "completion"]
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
DONE_LINE = b"data: [DONE]\n\n"
CHAT_TEMPLATE_TOKENS_PER_MESSAGE = 4  # role markers around each message (an estimate)

# vLLM's error `type` for the statuses the simulator sends.
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 429: "TooManyRequestsError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's ErrorResponse: `{"error": {"message", "type", "param", "code"}}`."""
    default = "BadRequestError" if status < 500 else "InternalServerError"
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, default),
                      "param": param, "code": status}}


def parse_request(kind: Kind, body: Any, served_model: str) -> GenerationRequest:
    """Read a /v1/chat/completions or /v1/completions body; a request the simulator cannot
    serve is a WireError (400, or 404 for an unknown model)."""
    if not isinstance(body, dict):
        raise WireError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served_model:
        raise WireError(404, f"The model `{model}` does not exist.", "model")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise WireError(400, "messages must be a non-empty list", "messages")
        texts = [message_text(m.get("content")) if isinstance(m, dict) else "" for m in messages]
        prompt_text = "\n".join(texts)
        prompt_tokens = sum(estimate_prompt_tokens(t) + CHAT_TEMPLATE_TOKENS_PER_MESSAGE for t in texts) + 1
    else:
        prompt_text, prompt_tokens = _completion_prompt(body.get("prompt"))
    n = optional_int(body, "n")
    if n not in (None, 1):
        raise WireError(400, "the simulator serves n=1 only", "n")
    budget = optional_int(body, "max_completion_tokens", 1)
    if budget is None:
        budget = optional_int(body, "max_tokens", 1)
    stream = optional_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise WireError(400, "Stream options can only be defined when `stream=True`.", "stream_options")
    include_usage = optional_bool(options, "include_usage", False) if options else False
    return GenerationRequest(
        model=served_model, prompt_text=prompt_text, prompt_tokens=prompt_tokens, requested_tokens=budget,
        num_ctx=None, seed=optional_int(body, "seed"), stop=stop_strings(body.get("stop")),
        stream=stream, include_usage=include_usage)


def _completion_prompt(prompt: Any) -> tuple[str, int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, max(1, estimate_prompt_tokens(prompt))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return " ".join(map(str, prompt)), len(prompt)
    raise WireError(400, "prompt must be a string or a list of token ids (one prompt per request)", "prompt")


def new_request_id(kind: Kind) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def _usage(finish: SequenceFinish) -> dict[str, int]:
    return {"prompt_tokens": finish.prompt_tokens,
            "total_tokens": finish.prompt_tokens + finish.completion_tokens,
            "completion_tokens": finish.completion_tokens}


class OpenAIStream:
    """Encodes one streamed response, chunk by chunk, as `data: {...}\\n\\n` bytes."""

    content_type = SSE_CONTENT_TYPE

    def __init__(self, kind: Kind, model: str, include_usage: bool) -> None:
        self.kind = kind
        self.model = model
        self.include_usage = include_usage
        self.request_id = new_request_id(kind)
        self.created = int(time.time())
        self._object = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self._started = False

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        chunk = {"id": self.request_id, "object": self._object, "created": self.created,
                 "model": self.model, "choices": choices, **extra}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def begin(self) -> bytes:
        """Nothing is sent before the first engine output (vLLM sends the role with it)."""
        return b""

    def chunk(self, text: str, finish: SequenceFinish | None) -> bytes:
        out = b""
        if self.kind == "chat":
            if not self._started:
                out = self._event([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}])
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None,
                                      "finish_reason": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}
        self._started = True
        if finish is not None:
            choice["finish_reason"] = finish.reason
            choice["stop_reason"] = finish.stop_reason
        return out + self._event([choice])

    def end(self, finish: SequenceFinish, timings: dict[str, int]) -> bytes:
        del timings  # vLLM reports no durations in the stream
        usage = self._event([], usage=_usage(finish)) if self.include_usage else b""
        return usage + DONE_LINE

    def error(self, message: str, status: int = 500) -> bytes:
        """A mid-stream error the way vLLM sends one: an error event, then [DONE]."""
        return b"data: " + orjson.dumps(error_body(status, message)) + b"\n\n" + DONE_LINE

    def body(self, text: str, finish: SequenceFinish, timings: dict[str, int]) -> dict[str, Any]:
        """The non-streaming response."""
        del timings
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text,
                                                             "tool_calls": []},
                                      "logprobs": None, "finish_reason": finish.reason,
                                      "stop_reason": finish.stop_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish.reason,
                      "stop_reason": finish.stop_reason, "prompt_logprobs": None}
            obj = "text_completion"
        response = {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                    "choices": [choice], "usage": _usage(finish)}
        if self.kind == "chat":
            response["prompt_logprobs"] = None
        return response

    @staticmethod
    def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
        return error_body(status, message, param)


def models_body(model: str, max_model_len: int, created: int) -> dict[str, Any]:
    """vLLM's /v1/models."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "vllm", "root": model, "parent": None,
                                        "max_model_len": max_model_len, "permission": []}]}
