"""Typed events that the dialects read from the bytes of a response.

A parser never hands dicts around: each thing seen on the wire that matters to the
diagnosis becomes one of these small frozen objects.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.record import StopReason, UpstreamErrorKind


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """A piece of generated output: `count` tokens at least (usually one), visible or reasoning.

    Reasoning is the model's thinking (`delta.reasoning`, `message.thinking`, a `thinking_delta`),
    counted apart from the visible answer but into the same total.
    """

    count: int = 1
    reasoning: bool = False


@dataclass(frozen=True, slots=True)
class Finish:
    """The server said why a choice ended, already read by its dialect.

    `reason` is the server's raw value (`finish_reason`, `done_reason`, `stop_type`,
    `stop_reason`, a Responses status); `stop` its canonical meaning from the dialect's table.
    `detail` names a matched stop sequence where the server says it. `distinguishes_stop` says
    whether the server has such a field at all: without one, a plain "stop" may be EOS or a
    requested stop string alike. `upstream_error` marks a finish that is the engine's failure
    (vLLM's `abort`, `error`); `context_limit` a length stop the server says the context caused
    (Anthropic's `model_context_window_exceeded`), whatever the budget. `limit_blind` marks an
    end the server reports alike for EOS and for a limit reached (llama.cpp's Responses API says
    `completed` for EOS, a spent budget and a full context). `matched_token` is the token id that
    ended a "stop" where the server names it (SGLang's `matched_stop`): EOS, unless the client asked
    to stop at it.
    """

    reason: str | None
    stop: StopReason
    choice: int = 0
    detail: str | None = None
    truncated: bool | None = None
    distinguishes_stop: bool = True
    upstream_error: UpstreamErrorKind | None = None
    context_limit: bool = False
    limit_blind: bool = False
    matched_token: int | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts reported by the server itself (authoritative, unlike counted deltas).

    A later report fills in what an earlier one left None; `reasoning_tokens` is the part of
    `completion_tokens` spent thinking, where the server says.
    """

    prompt_tokens: int | None
    completion_tokens: int | None
    reasoning_tokens: int | None = None
    ignored: tuple[str, ...] = ()  # `name=value` of counts the server gave out of any range: not taken


@dataclass(frozen=True, slots=True)
class ServerTimings:
    """Durations reported by the server (Ollama's `*_duration` in ns, llama.cpp's `timings`, vLLM's
    per-request `metrics`). `queue_s`: the time it says the request queued (vLLM); `source` names
    who measured them for the record (`server_durations`, `server_metrics`)."""

    total_s: float | None = None
    load_s: float | None = None
    prompt_eval_s: float | None = None
    eval_s: float | None = None
    queue_s: float | None = None
    source: str = "server_durations"


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    """The server reported an error inside a response body (mid-stream or as the JSON body).

    `overloaded` marks an error that says the server is too busy to take the request
    (Anthropic's `overloaded_error`): a rejection, not a failure.
    """

    message: str
    type: str | None = None
    overloaded: bool = False


@dataclass(frozen=True, slots=True)
class Done:
    """The explicit end of a stream (`data: [DONE]`, Ollama's `done: true`, `message_stop`)."""


@dataclass(frozen=True, slots=True)
class AnswerText:
    """Text of an answer's structured part, read only for a request that asked for structure (tools,
    a JSON format): `part` is `content` (the visible answer) or `arguments` (a tool call's), `key`
    tells the tool calls of one answer apart. Kept by the diagnosis, bounded, to check that the part
    is whole JSON; never logged or stored."""

    part: str
    key: str
    text: str


@dataclass(frozen=True, slots=True)
class ParseError:
    """Bytes that could not be understood; they were still forwarded unchanged."""

    message: str


Event = TokenDelta | Finish | Usage | ServerTimings | ErrorEvent | Done | AnswerText | ParseError

# Shared instances for the events seen on nearly every chunk, so the hot path allocates nothing.
ONE_TOKEN = TokenDelta(1)
ONE_REASONING_TOKEN = TokenDelta(1, reasoning=True)
DONE = Done()
NO_EVENTS: tuple[Event, ...] = ()  # (a tuple: no caller can add to what every parse shares)
