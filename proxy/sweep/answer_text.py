"""The text of a sweep's answer, as the client got it, kept only as a hash: same answer or not.

The sweep sends one seeded request again and again; at temperature 0 (or a fixed seed) a server
whose numerics do not depend on the batch gives the same text at every concurrency. This reads the
visible text from the sweep's own copy of each stream (its four dialects: OpenAI chat SSE,
Responses SSE, Anthropic SSE, Ollama NDJSON) and keeps a SHA-256 of it; the text itself is
dropped. Bounded: at most MAX_BYTES of a stream are kept to read (beyond, no hash).
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

MAX_BYTES = 8 << 20


class AnswerText:
    """Collects one response's bytes; `digest()` hashes its visible text (None: none, or unreadable)."""

    __slots__ = ("_chunks", "_dialect", "_size")

    def __init__(self, dialect: str) -> None:
        self._dialect = dialect
        self._chunks: list[bytes] = []
        self._size = 0

    def feed(self, chunk: bytes) -> None:
        self._size += len(chunk)
        if self._size <= MAX_BYTES:
            self._chunks.append(chunk)

    def digest(self) -> str | None:
        if self._size > MAX_BYTES or not self._chunks:
            return None
        pieces: list[str] = []
        for line in b"".join(self._chunks).splitlines():
            line = line.strip()
            if self._dialect != "ollama":
                if not line.startswith(b"data:"):
                    continue
                line = line[5:].strip()
            if not line or line == b"[DONE]":
                continue
            try:
                event = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            text = _text_of(self._dialect, event)
            if text:
                pieces.append(text)
        if not pieces:
            return None
        return hashlib.sha256("".join(pieces).encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _text_of(dialect: str, event: Any) -> str | None:
    if not isinstance(event, dict):
        return None
    if dialect == "ollama":
        message = event.get("message")
        return message.get("content") if isinstance(message, dict) else None
    if dialect == "anthropic":
        delta = event.get("delta")
        return delta.get("text") if event.get("type") == "content_block_delta" and isinstance(delta, dict) else None
    if dialect == "responses":
        delta = event.get("delta")
        return delta if event.get("type") == "response.output_text.delta" and isinstance(delta, str) else None
    choices = event.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        delta = choices[0].get("delta")
        return delta.get("content") if isinstance(delta, dict) else None
    return None
