"""Ollama's native wire format: NDJSON lines, streaming unless the request says `stream: false`.

Field names and order follow Ollama's api/types.go (ChatResponse, GenerateResponse, Metrics):
`done_reason` and the `*_duration` fields (nanoseconds) appear only on the final `done: true`
line; a mid-stream error is one `{"error": "..."}` line.
"""

from __future__ import annotations

import hashlib
import time
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

Kind = Literal["chat", "generate"]
NDJSON_CONTENT_TYPE = "application/x-ndjson"
CHAT_TEMPLATE_TOKENS_PER_MESSAGE = 4  # role markers around each message (an estimate)
OLLAMA_VERSION = "0.12.0"
# What the simulated model claims to be (for /api/tags and /api/ps).
MODEL_SIZE_BYTES = 4_683_087_332
MODEL_DETAILS = {"parent_model": "", "format": "gguf", "family": "llama", "families": ["llama"],
                 "parameter_size": "7B", "quantization_level": "Q4_K_M"}
KEEP_ALIVE_S = 300


def created_at(now_ns: int | None = None) -> str:
    """Go's RFC 3339 with nanoseconds (trailing zeros dropped), in UTC."""
    ns = time.time_ns() if now_ns is None else now_ns
    seconds, fraction = divmod(ns, 1_000_000_000)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    digits = f"{fraction:09d}".rstrip("0")
    return f"{stamp}.{digits}Z" if digits else f"{stamp}Z"


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """Ollama's error body: `{"error": "..."}` (the status says the rest)."""
    del status, param
    return {"error": message}


def model_matches(requested: str, served: str) -> bool:
    """Ollama names carry a tag; `sim-7b` and `sim-7b:latest` are the same model."""
    def full(name: str) -> str:
        return name if ":" in name else f"{name}:latest"
    return full(requested) == full(served)


def parse_request(kind: Kind, body: Any, served_model: str) -> GenerationRequest:
    """Read an /api/chat or /api/generate body. An empty prompt or message list is a load
    request (answered with done_reason `load`): its prompt_tokens is 0."""
    if not isinstance(body, dict):
        raise WireError(400, "invalid request body: expected a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise WireError(400, "model is required")
    if not model_matches(model, served_model):
        raise WireError(404, f'model "{model}" not found, try pulling it first')
    if kind == "chat":
        messages = body.get("messages") or []
        if not isinstance(messages, list):
            raise WireError(400, "messages must be a list")
        texts = [message_text(m.get("content")) if isinstance(m, dict) else "" for m in messages]
        prompt_text = "\n".join(texts)
        prompt_tokens = (sum(estimate_prompt_tokens(t) + CHAT_TEMPLATE_TOKENS_PER_MESSAGE for t in texts) + 1
                         if texts else 0)
    else:
        prompt = body.get("prompt") or ""
        system = body.get("system") or ""
        if not isinstance(prompt, str) or not isinstance(system, str):
            raise WireError(400, "prompt and system must be strings")
        prompt_text = f"{system}\n{prompt}" if system else prompt
        prompt_tokens = estimate_prompt_tokens(prompt_text) if prompt else 0
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise WireError(400, "options must be an object")
    num_predict = optional_int(options, "num_predict")
    return GenerationRequest(
        model=model, prompt_text=prompt_text, prompt_tokens=prompt_tokens,
        # Ollama: num_predict -1 (infinite) and -2 (fill the context) and 0 mean no budget
        requested_tokens=num_predict if num_predict is not None and num_predict > 0 else None,
        num_ctx=optional_int(options, "num_ctx", 1), seed=optional_int(options, "seed"),
        stop=stop_strings(options.get("stop"), "options.stop"),
        stream=optional_bool(body, "stream", True))


class OllamaStream:
    """Encodes one response as NDJSON lines (streaming) or one JSON object."""

    content_type = NDJSON_CONTENT_TYPE

    def __init__(self, kind: Kind, model: str) -> None:
        self.kind = kind
        self.model = model

    def _line(self, obj: dict[str, Any]) -> bytes:
        return orjson.dumps(obj) + b"\n"

    def _head(self, text: str) -> dict[str, Any]:
        head: dict[str, Any] = {"model": self.model, "created_at": created_at()}
        if self.kind == "chat":
            head["message"] = {"role": "assistant", "content": text}
        else:
            head["response"] = text
        return head

    def begin(self) -> bytes:
        return b""

    def chunk(self, text: str, finish: SequenceFinish | None) -> bytes:
        """A token's line; the end comes as its own line (see `end`)."""
        del finish
        return self._line({**self._head(text), "done": False}) if text else b""

    def _final(self, text: str, finish: SequenceFinish, timings: dict[str, int]) -> dict[str, Any]:
        final = self._head(text)
        final["done_reason"] = finish.reason
        final["done"] = True
        final.update(timings)
        final["prompt_eval_count"] = finish.prompt_tokens
        final["eval_count"] = finish.completion_tokens
        return {key: final[key] for key in _FINAL_ORDER if key in final}

    def end(self, finish: SequenceFinish, timings: dict[str, int]) -> bytes:
        return self._line(self._final("", finish, timings))

    def error(self, message: str, status: int = 500) -> bytes:
        del status
        return self._line({"error": message})

    def body(self, text: str, finish: SequenceFinish, timings: dict[str, int]) -> dict[str, Any]:
        return self._final(text, finish, timings)

    @staticmethod
    def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
        return error_body(status, message, param)

    def load_body(self) -> dict[str, Any]:
        """What Ollama answers to an empty prompt: the model is loaded, nothing generated."""
        return {**self._head(""), "done_reason": "load", "done": True}


_FINAL_ORDER = ("model", "created_at", "message", "response", "done_reason", "done", "total_duration",
                "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count", "eval_duration")


def timings_ns(arrived: float, scheduled: float | None, first_output: float | None, ended: float) -> dict[str, int]:
    """Ollama's durations in ns from monotonic times. There is no model to load: the simulator
    reports the wait for a place in the batch as load_duration."""
    scheduled = arrived if scheduled is None else scheduled
    first_output = scheduled if first_output is None else first_output
    def ns(seconds: float) -> int:
        return max(1, round(seconds * 1e9))
    return {"total_duration": ns(ended - arrived), "load_duration": ns(scheduled - arrived),
            "prompt_eval_duration": ns(first_output - scheduled), "eval_duration": ns(ended - first_output)}


def digest(model: str) -> str:
    return hashlib.sha256(model.encode()).hexdigest()


def tagged(model: str) -> str:
    return model if ":" in model else f"{model}:latest"


def tags_body(model: str, modified_at: str) -> dict[str, Any]:
    """/api/tags: the one model the simulator has."""
    return {"models": [{"name": tagged(model), "model": tagged(model), "modified_at": modified_at,
                        "size": MODEL_SIZE_BYTES, "digest": digest(model), "details": MODEL_DETAILS}]}


def ps_body(model: str, context_length: int) -> dict[str, Any]:
    """/api/ps: the model is always loaded, fully in (simulated) VRAM."""
    expires = created_at(time.time_ns() + KEEP_ALIVE_S * 1_000_000_000)
    return {"models": [{"name": tagged(model), "model": tagged(model), "size": MODEL_SIZE_BYTES,
                        "digest": digest(model), "details": MODEL_DETAILS, "expires_at": expires,
                        "size_vram": MODEL_SIZE_BYTES, "context_length": context_length}]}
