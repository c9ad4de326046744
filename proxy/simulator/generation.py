"""What a generation request asks for, once read from either dialect's body."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.simulator.engine import SequenceSpec
from proxy.simulator.sampling import AnswerSampler
from proxy.simulator.settings import SimulatorConfig


class WireError(Exception):
    """A request the simulator refuses before generating; becomes the dialect's error body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    model: str  # as the client named it
    prompt_text: str  # what seeds the answer (never logged)
    prompt_tokens: int
    requested_tokens: int | None
    num_ctx: int | None
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool = False

    def spec(self, config: SimulatorConfig) -> SequenceSpec:
        """The engine's view: context per slot or per model, and the seeded answer."""
        if self.num_ctx is not None:
            context, cause = self.num_ctx, "length_model_ctx"
        elif config.slot_ctx_tokens is not None:
            context, cause = config.slot_ctx_tokens, "length_slot_ctx"
        else:
            context, cause = config.ctx_size, "length_model_ctx"
        seed = config.seed if self.seed is None else self.seed
        sampler = AnswerSampler(seed, self.prompt_text, config.natural_tokens, config.natural_spread)
        return SequenceSpec(self.prompt_tokens, self.requested_tokens, context, cause,  # type: ignore[arg-type]
                            sampler, self.stop)


def optional_int(body: dict[str, Any], key: str, minimum: int | None = None) -> int | None:
    """An integer field, or None when absent or null; a wrong type is a 400."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise WireError(400, f"{key} must be an integer, got {value!r}", key)
    if minimum is not None and value < minimum:
        raise WireError(400, f"{key} must be at least {minimum}, got {value}", key)
    return value


def optional_bool(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise WireError(400, f"{key} must be a boolean, got {value!r}", key)
    return value


def stop_strings(value: Any, key: str = "stop") -> tuple[str, ...]:
    """`stop` as a string or a list of strings; empty strings are ignored."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise WireError(400, f"{key} must be a string or a list of strings", key)
    return tuple(s for s in items if s)


def message_text(content: Any) -> str:
    """A chat message's text: a string, or the text parts of a list of content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    raise WireError(400, "message content must be a string or a list of content parts", "messages")
