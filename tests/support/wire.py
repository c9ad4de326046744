"""Byte-exact builders of the streams real servers send (vLLM/OpenAI SSE, Ollama NDJSON)."""

from __future__ import annotations

from typing import Any

import orjson


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def chat_chunk(content: str | None = None, finish_reason: str | None = None, *, index: int = 0,
               stop_reason: Any = None, role: bool = False, model: str = "m") -> dict[str, Any]:
    """One `chat.completion.chunk` as vLLM's OpenAI server writes it."""
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1733000000, "model": model,
            "choices": [choice]}


def usage_chunk(prompt: int, completion: int, model: str = "m") -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1733000000, "model": model,
            "choices": [], "usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                                     "completion_tokens": completion}}


def openai_stream(tokens: int, finish_reason: str = "stop", *, usage: bool = True, stop_reason: Any = None,
                  prompt: int = 7) -> list[bytes]:
    """A whole streamed chat completion: role chunk, `tokens` content chunks, finish, usage, [DONE]."""
    out = [sse(chat_chunk("", role=True))]
    out += [sse(chat_chunk(f"t{i} ")) for i in range(tokens)]
    out.append(sse(chat_chunk(None, finish_reason, stop_reason=stop_reason)))
    if usage:
        out.append(sse(usage_chunk(prompt, tokens)))
    out.append(DONE)
    return out


def openai_completion(tokens: int, finish_reason: str = "stop", prompt: int = 7) -> bytes:
    return orjson.dumps({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1733000000, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x " * tokens},
                     "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}],
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt + tokens, "completion_tokens": tokens}})


def ollama_line(obj: Any) -> bytes:
    return orjson.dumps(obj) + b"\n"


def ollama_stream(tokens: int, done_reason: str = "stop", *, chat: bool = True, prompt: int = 26) -> list[bytes]:
    """Ollama's /api/chat (or /api/generate) NDJSON: one line per token, then the done line."""
    out = []
    for i in range(tokens):
        piece: dict[str, Any] = {"model": "llama3.2", "created_at": "2026-12-02T10:00:00.000000Z"}
        if chat:
            piece["message"] = {"role": "assistant", "content": f"t{i} "}
        else:
            piece["response"] = f"t{i} "
        piece["done"] = False
        out.append(ollama_line(piece))
    final: dict[str, Any] = {"model": "llama3.2", "created_at": "2026-12-02T10:00:01.000000Z"}
    if chat:
        final["message"] = {"role": "assistant", "content": ""}
    else:
        final["response"] = ""
    final.update({"done": True, "done_reason": done_reason, "total_duration": 1_500_000_000,
                  "load_duration": 100_000_000, "prompt_eval_count": prompt, "prompt_eval_duration": 200_000_000,
                  "eval_count": tokens, "eval_duration": 1_000_000_000})
    out.append(ollama_line(final))
    return out


SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8"}
NDJSON_HEADERS = {"Content-Type": "application/x-ndjson"}
JSON_HEADERS = {"Content-Type": "application/json"}
