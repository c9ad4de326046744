"""Typed events that the dialect parsers yield from the bytes of a response.

A parser never hands dicts around: each thing seen on the wire that matters to the
diagnosis becomes one of these small frozen objects.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """A content-bearing chunk: one streamed piece of generated text (usually one token)."""

    count: int = 1


@dataclass(frozen=True, slots=True)
class Finish:
    """The server said why a choice ended.

    `reason` is the raw value (`finish_reason`, Ollama's `done_reason`, llama.cpp's
    `stop_type`); `detail` carries what distinguishes a stop sequence from EOS where the
    server says it (vLLM's `stop_reason`, llama.cpp's `stopping_word`), else None.
    `distinguishes_stop` says whether the server has such a field at all: without one, a
    plain "stop" may be EOS or a requested stop string alike.
    """

    reason: str | None
    choice: int = 0
    detail: str | None = None
    truncated: bool | None = None
    distinguishes_stop: bool = True


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts reported by the server itself (authoritative, unlike counted deltas)."""

    prompt_tokens: int | None
    completion_tokens: int | None


@dataclass(frozen=True, slots=True)
class ServerTimings:
    """Durations reported by the server (Ollama's `*_duration` in ns, llama.cpp's `timings`)."""

    total_s: float | None = None
    load_s: float | None = None
    prompt_eval_s: float | None = None
    eval_s: float | None = None


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    """The server reported an error inside a response body (mid-stream or as the JSON body)."""

    message: str
    type: str | None = None


@dataclass(frozen=True, slots=True)
class Done:
    """The explicit end of an SSE stream (`data: [DONE]`) or Ollama's `done: true` line."""


@dataclass(frozen=True, slots=True)
class ParseError:
    """Bytes that could not be understood; they were still forwarded unchanged."""

    message: str


Event = TokenDelta | Finish | Usage | ServerTimings | ErrorEvent | Done | ParseError

# Shared instances for the events seen on nearly every chunk, so the hot path allocates nothing.
ONE_TOKEN = TokenDelta(1)
DONE = Done()
