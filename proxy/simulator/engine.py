"""The simulated engine: continuous batching over a paged KV cache, stepped by the caller.

Pure and deterministic: `submit` and `step` take the current time and return what happened,
so the policies are tested with a virtual clock; `driver.py` runs it against the wall clock.
One step advances every running sequence by one token, like vLLM's scheduler loop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from proxy.simulator.sampling import AnswerSampler
from proxy.simulator.settings import SimulatorConfig

# Why a sequence really ended. The wire says only `stop` or `length`; this is the ground truth
# the simulator exports (`llm_sim_finished_total`) so tests can check the proxy's diagnosis.
FinishCause = Literal[
    "eos",
    "stop_sequence",
    "length_requested",  # the client's own max_tokens / num_predict
    "length_kv_clamp",  # the clamp policy lowered the budget
    "length_slot_ctx",  # the llama.cpp-style per-slot context is full
    "length_model_ctx",  # the model's (or the request's num_ctx) context is full
    "length_kv_capacity",  # the whole KV cache is smaller than the request's context
    "deadline",  # the hidden server deadline: reported as `stop`
]
FINISH_CAUSES: tuple[str, ...] = FinishCause.__args__  # type: ignore[attr-defined]
WireReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class SequenceSpec:
    """One request as the engine sees it."""

    prompt_tokens: int
    requested_tokens: int | None  # None: up to the context
    context_tokens: int  # prompt + answer may not exceed this
    context_cause: FinishCause  # length_slot_ctx or length_model_ctx
    sampler: AnswerSampler
    stop: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SequenceFinish:
    """How a sequence ended: what the wire says (`reason`, vLLM's `stop_reason`) and the truth."""

    reason: WireReason
    cause: FinishCause
    stop_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    preemptions: int


@dataclass(frozen=True, slots=True)
class Scheduled:
    """The sequence got a place in the batch (first time, or again after a preemption)."""

    seq_id: int


@dataclass(frozen=True, slots=True)
class Output:
    """One step's result for one sequence: its token's text (`""` for EOS) and maybe the end."""

    seq_id: int
    text: str
    token: bool  # False when the sequence ended without producing a token (deadline)
    finish: SequenceFinish | None = None


@dataclass(frozen=True, slots=True)
class Preempted:
    """The sequence lost its KV blocks; it waits and will be recomputed."""

    seq_id: int


@dataclass(frozen=True, slots=True)
class Rejected:
    """The engine refused the request; `status` and `message` go into the dialect's error body."""

    status: int
    message: str
    kind: Literal["kv_full", "prompt_too_long"]


EngineEvent = Scheduled | Output | Preempted


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one engine step did and how long it takes (0 when nothing ran)."""

    duration_s: float
    batch: int
    events: tuple[EngineEvent, ...]


@dataclass(slots=True)
class _Sequence:
    seq_id: int
    spec: SequenceSpec
    deadline_at: float | None
    limit: int  # most completion tokens, after every cap
    limit_cause: FinishCause
    generated: int = 0
    text_tail: str = ""  # the end of the text, enough to find a stop string
    blocks: int = 0  # blocks held (reserved for clamp/reject, allocated for preempt/none)
    reserved: bool = False
    needs_prefill: bool = True
    preemptions: int = 0


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks needed to hold `tokens` tokens."""
    return -(-tokens // block_size)


def clamp_grant(prompt_tokens: int, limit: int, free_blocks: int, sharers: int, block_size: int) -> int:
    """Tokens the `clamp` policy lets a new request generate: an equal share of the free blocks
    for each request waiting for them, but never less than one block's worth (fewer sharers
    then; 0 means wait), so no answer is cut to a token or two."""
    least = min(limit, block_size)
    for n in range(max(1, sharers), 0, -1):
        grant = (free_blocks // n) * block_size - prompt_tokens
        if grant >= least:
            return grant
    return 0


@dataclass(slots=True)
class EngineCounters:
    """Cumulative counters, read by the /metrics collector."""

    preemptions: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    finished_by_cause: dict[str, int] = field(default_factory=dict)
    aborted: int = 0


class EngineCore:
    """Scheduler and KV-cache accounting; knows nothing of HTTP or of the wall clock."""

    def __init__(self, config: SimulatorConfig) -> None:
        self.config = config
        self._next_id = 1
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._used_blocks = 0
        self.counters = EngineCounters()

    # --- state read by /metrics and tests ------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def used_blocks(self) -> int:
        return self._used_blocks

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (0-1); 0 when the cache is unlimited."""
        total = self.config.kv_blocks
        return min(1.0, self._used_blocks / total) if total else 0.0

    @property
    def idle(self) -> bool:
        return not self._running and not self._waiting

    # --- requests --------------------------------------------------------------------------
    def submit(self, spec: SequenceSpec, now: float) -> int | Rejected:
        """Accept a request (its id) or refuse it at once; it runs from the next step."""
        cfg = self.config
        limit, cause = spec.context_tokens - spec.prompt_tokens, spec.context_cause
        if spec.requested_tokens is not None and spec.requested_tokens <= limit:
            limit, cause = spec.requested_tokens, "length_requested"
        capacity = cfg.kv_capacity_tokens
        if capacity is not None and cfg.kv_policy != "none" and capacity - spec.prompt_tokens < limit:
            limit, cause = capacity - spec.prompt_tokens, "length_kv_capacity"
        if limit < 1:
            context = min(spec.context_tokens, capacity or spec.context_tokens)
            return Rejected(400, f"This model's maximum context length is {context} tokens. However, "
                                 f"your request has {spec.prompt_tokens} input tokens.", "prompt_too_long")
        deadline_at = now + cfg.deadline_s if cfg.deadline_s > 0 else None
        seq = _Sequence(self._next_id, spec, deadline_at, limit, cause)
        if cfg.kv_policy == "reject" and capacity is not None:
            need = blocks_for(spec.prompt_tokens + limit, cfg.block_size)
            if self._used_blocks + need > cfg.kv_blocks:
                self.counters.rejected += 1
                free = cfg.kv_blocks - self._used_blocks
                return Rejected(cfg.reject_status, f"KV cache full: the request needs {need} blocks, "
                                                   f"{free} of {cfg.kv_blocks} are free", "kv_full")
            self._hold(seq, need)
            seq.reserved = True
        self._next_id += 1
        self._waiting.append(seq)
        return seq.seq_id

    def abort(self, seq_id: int) -> bool:
        """Drop a sequence wherever it is (its client went away); True if it was there."""
        for queue in (self._running, self._waiting):
            for seq in queue:
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    self._release(seq)
                    self.counters.aborted += 1
                    return True
        return False

    # --- the engine loop -------------------------------------------------------------------
    def step(self, now: float) -> StepResult:
        """Run one engine iteration at time `now`: end what is past its deadline, admit what
        fits, then produce one token for every running sequence."""
        events: list[EngineEvent] = []
        self._expire(now, events)
        self._admit(events)
        batch, prefill_tokens = self._schedule(events)
        if not batch:
            return StepResult(0.0, 0, tuple(events))
        cfg = self.config
        duration = cfg.step_time_s(len(batch)) + prefill_tokens * cfg.prefill_time_per_token_s
        for seq in batch:
            events.append(self._advance(seq, len(batch)))
        return StepResult(duration, len(batch), tuple(events))

    def _expire(self, now: float, events: list[EngineEvent]) -> None:
        for queue in (self._running, self._waiting):
            for seq in [s for s in queue if s.deadline_at is not None and now >= s.deadline_at]:
                events.append(Output(seq.seq_id, "", False, self._finish(seq, "stop", "deadline", None)))

    def _admit(self, events: list[EngineEvent]) -> None:
        """Move waiting sequences into the batch in arrival order while they fit."""
        cfg = self.config
        capacity = cfg.kv_capacity_tokens
        while self._waiting:
            seq = self._waiting[0]
            if len(self._running) >= cfg.max_num_seqs or (cfg.slots and len(self._running) >= cfg.slots):
                return
            if capacity is not None and cfg.kv_policy == "clamp" and not seq.reserved:
                room = cfg.max_num_seqs - len(self._running)
                if cfg.slots:
                    room = min(room, cfg.slots - len(self._running))
                sharers = min(room, sum(1 for s in self._waiting if not s.reserved))
                grant = clamp_grant(seq.spec.prompt_tokens, seq.limit, cfg.kv_blocks - self._used_blocks,
                                    sharers, cfg.block_size)
                if grant < 1:
                    return  # wait until a running sequence frees its blocks
                if grant < seq.limit:
                    seq.limit, seq.limit_cause = grant, "length_kv_clamp"
                self._hold(seq, blocks_for(seq.spec.prompt_tokens + seq.limit, cfg.block_size))
                seq.reserved = True
            elif cfg.kv_policy in ("preempt", "none") or capacity is None:
                need = blocks_for(seq.spec.prompt_tokens + seq.generated + 1, cfg.block_size)
                if cfg.kv_policy == "preempt" and capacity is not None \
                        and self._used_blocks + need > cfg.kv_blocks:
                    return
                self._hold(seq, need)
            self._waiting.popleft()
            seq.needs_prefill = True
            self._running.append(seq)
            events.append(Scheduled(seq.seq_id))

    def _schedule(self, events: list[EngineEvent]) -> tuple[list[_Sequence], int]:
        """The sequences that run this step, growing their KV blocks; under `preempt`, the
        newest running sequence gives its blocks up when none are free (vLLM's policy)."""
        cfg = self.config
        grow = cfg.kv_policy in ("preempt", "none") or cfg.kv_capacity_tokens is None
        limited = cfg.kv_policy == "preempt" and cfg.kv_capacity_tokens is not None
        batch: list[_Sequence] = []
        index = 0
        while index < len(self._running):
            seq = self._running[index]
            if grow:
                need = blocks_for(seq.spec.prompt_tokens + seq.generated + 1, cfg.block_size)
                while seq.blocks < need:
                    if not limited or self._used_blocks < cfg.kv_blocks:
                        self._hold(seq, 1)
                        continue
                    victim = self._running.pop()
                    self._preempt(victim, events)
                    if victim is seq:
                        break
                if seq not in self._running:
                    break
            batch.append(seq)
            index += 1
        prefill = 0
        for seq in batch:
            if seq.needs_prefill:
                prefill += seq.spec.prompt_tokens + seq.generated
                seq.needs_prefill = False
        return batch, prefill

    def _preempt(self, seq: _Sequence, events: list[EngineEvent]) -> None:
        self._used_blocks -= seq.blocks
        seq.blocks = 0
        seq.preemptions += 1
        self.counters.preemptions += 1
        self._waiting.appendleft(seq)
        events.append(Preempted(seq.seq_id))

    def _advance(self, seq: _Sequence, batch: int = 1) -> Output:
        """Produce one token for a sequence and end it if that token ends it."""
        seq.generated += 1
        self.counters.generation_tokens += 1
        if seq.generated > seq.spec.sampler.natural_tokens:
            return Output(seq.seq_id, "", True, self._finish(seq, "stop", "eos", None))
        text = seq.spec.sampler.next_token()
        if batch > 1 and self.config.batch_variance:
            text = seq.spec.sampler.perturbed(text, batch, self.config.batch_variance)
        if seq.spec.stop:
            tail = seq.text_tail + text
            for stop in seq.spec.stop:
                at = tail.find(stop)
                if at >= 0:
                    # vLLM leaves the stop string out of the text and names it in stop_reason
                    visible = text[: max(0, at - len(seq.text_tail))]
                    return Output(seq.seq_id, visible, True, self._finish(seq, "stop", "stop_sequence", stop))
            keep = max(len(s) for s in seq.spec.stop)
            seq.text_tail = tail[-keep:]
        if seq.generated >= seq.limit:
            return Output(seq.seq_id, text, True, self._finish(seq, "length", seq.limit_cause, None))
        return Output(seq.seq_id, text, True)

    def _finish(self, seq: _Sequence, reason: WireReason, cause: FinishCause, stop: str | None) -> SequenceFinish:
        if seq in self._running:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self._release(seq)
        c = self.counters
        c.prompt_tokens += seq.spec.prompt_tokens
        c.finished_by_reason[reason] = c.finished_by_reason.get(reason, 0) + 1
        c.finished_by_cause[cause] = c.finished_by_cause.get(cause, 0) + 1
        return SequenceFinish(reason, cause, stop, seq.spec.prompt_tokens, seq.generated, seq.preemptions)

    def _hold(self, seq: _Sequence, blocks: int) -> None:
        seq.blocks += blocks
        self._used_blocks += blocks

    def _release(self, seq: _Sequence) -> None:
        self._used_blocks -= seq.blocks
        seq.blocks = 0
