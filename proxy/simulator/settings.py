"""The simulator's knobs (one frozen dataclass) and a preset per short-answer mechanism."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Literal

from proxy.config import ConfigError

KvPolicy = Literal["preempt", "clamp", "reject", "none"]
KV_POLICIES: tuple[str, ...] = KvPolicy.__args__  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class SimulatorConfig:
    """Everything the simulated server does; the defaults are the `clamp` scenario.

    Sized for the demo: max_tokens 128, prompts of 5-64 tokens, natural answers of 101-123 tokens.
    With the defaults 1-2 concurrent answers end on their own (`stop`); from 4 they end `length`.
    """

    model: str = "sim-7b"
    token_time_s: float = 0.004  # decode step of a batch of one
    batch_slowdown: float = 0.3  # step = token_time * (1 + batch_slowdown * (batch - 1))
    prefill_time_per_token_s: float = 0.0001
    natural_tokens: int = 112  # mean length of an answer that ends on its own (EOS)
    natural_spread: float = 0.1  # natural lengths are uniform in mean * (1 -/+ spread): 101-123
    seed: int = 0  # used when a request has no seed of its own
    kv_blocks: int = 24  # KV-cache blocks shared by all sequences; 0 = unlimited
    block_size: int = 16  # tokens per block
    kv_policy: KvPolicy = "clamp"  # what happens when the blocks run out
    slots: int = 0  # llama.cpp --parallel: each slot gets ctx_size / slots tokens; 0 = off
    ctx_size: int = 4096  # the model's context (prompt + answer)
    deadline_s: float = 0.0  # server-side wall-clock limit per request; answers end as if complete
    max_num_seqs: int = 256  # most sequences in one batch (vLLM --max-num-seqs)
    reject_status: int = 503  # status of a request refused by the `reject` policy
    # Batch-shape nondeterminism: in a batch of more than one, each token's word differs from the
    # seeded one with this probability (the numerics of a batched step), while the answer still ends
    # by EOS at its natural length: complete answers that change with load. 0: answers depend on the
    # seed and prompt alone.
    batch_variance: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.batch_variance <= 1:
            raise ConfigError(f"invalid batch_variance {self.batch_variance!r}: must be in [0, 1]")
        for name in ("token_time_s", "batch_slowdown", "prefill_time_per_token_s", "deadline_s"):
            value = getattr(self, name)
            if not value >= 0 or value == float("inf"):
                raise ConfigError(f"invalid {name} {value!r}: must be 0 or a positive number")
        if not 0 <= self.natural_spread < 1:
            raise ConfigError(f"invalid natural_spread {self.natural_spread!r}: must be in [0, 1)")
        for name in ("natural_tokens", "block_size", "ctx_size", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"invalid {name} {getattr(self, name)!r}: must be at least 1")
        for name in ("kv_blocks", "slots", "seed"):
            if getattr(self, name) < 0:
                raise ConfigError(f"invalid {name} {getattr(self, name)!r}: must be 0 or more")
        if self.kv_policy not in KV_POLICIES:
            raise ConfigError(f"invalid kv_policy {self.kv_policy!r}: choose one of {', '.join(KV_POLICIES)}")
        if self.slots > self.ctx_size:
            raise ConfigError(f"invalid slots {self.slots}: more slots than ctx_size {self.ctx_size} tokens")
        if self.reject_status not in (429, 503):
            raise ConfigError(f"invalid reject_status {self.reject_status}: must be 429 or 503")
        if not self.model.strip():
            raise ConfigError("invalid model name: empty")

    @property
    def kv_capacity_tokens(self) -> int | None:
        """Tokens the KV cache holds, or None when it is unlimited."""
        return self.kv_blocks * self.block_size if self.kv_blocks else None

    @property
    def slot_ctx_tokens(self) -> int | None:
        """Context of one llama.cpp-style slot, or None when slots are off."""
        return self.ctx_size // self.slots if self.slots else None

    def step_time_s(self, batch: int) -> float:
        """Decode step time for a batch: memory-bound, so it grows with the batch size."""
        return self.token_time_s * (1 + self.batch_slowdown * (max(batch, 1) - 1))


FIELD_NAMES = frozenset(f.name for f in fields(SimulatorConfig))

_BASE = SimulatorConfig()

# One preset per mechanism; docs/simulator.md says which stop reason each produces, and from
# which concurrency (for max_tokens=128 and a short prompt).
SCENARIOS: dict[str, SimulatorConfig] = {
    # Each request reserves prompt+max_tokens; requests waiting together split the free blocks and
    # get their share as budget: `length` below max_tokens from 4 (two full ones fit).
    "clamp": _BASE,
    # Blocks are allocated as sequences grow; when none are left the newest is paused and later
    # recomputed: answers still end `stop`, but take longer from 4.
    "preempt": replace(_BASE, kv_policy="preempt"),
    # Requests whose reservation does not fit are refused with 503 and a JSON error: from 4.
    "reject": replace(_BASE, kv_policy="reject"),
    # llama.cpp --parallel 4 with -c 384: each slot has 96 tokens; long answers end `length` at
    # every concurrency (the split is static), and requests beyond 4 wait for a slot.
    "slots": replace(_BASE, kv_blocks=0, kv_policy="none", slots=4, ctx_size=384),
    # A hidden 0.85 s server deadline: the answer ends `stop` as if complete; from 4 the batch is
    # slow enough that many are cut short.
    "deadline": replace(_BASE, kv_blocks=0, kv_policy="none", deadline_s=0.85, batch_slowdown=0.5),
    # Nothing runs out: every answer ends on its own at every concurrency.
    "healthy": replace(_BASE, kv_blocks=0, kv_policy="none"),
    # Nothing runs out, but a batched step's numerics change the words: from 2, answers end on their
    # own, as long as alone, with other text.
    "nondeterministic": replace(_BASE, kv_blocks=0, kv_policy="none", batch_variance=0.3),
}
