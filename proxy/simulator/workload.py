"""Closed-loop workloads on a virtual clock: what a scenario does at each concurrency, in
milliseconds of CPU instead of seconds of waiting (tests and the docs' table use it)."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.simulator.engine import EngineCore, Output, Rejected, SequenceFinish, SequenceSpec
from proxy.simulator.sampling import AnswerSampler
from proxy.simulator.settings import SimulatorConfig

IDLE_TICK_S = 0.001


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request's fate in a virtual run: its finish (None if rejected) and its latency."""

    finish: SequenceFinish | None
    rejected: Rejected | None
    latency_s: float


def spec_for(config: SimulatorConfig, prompt: str, prompt_tokens: int, max_tokens: int | None) -> SequenceSpec:
    """A request as the server would build it for this prompt (model context, no num_ctx)."""
    if config.slot_ctx_tokens is not None:
        context, cause = config.slot_ctx_tokens, "length_slot_ctx"
    else:
        context, cause = config.ctx_size, "length_model_ctx"
    sampler = AnswerSampler(config.seed, prompt, config.natural_tokens, config.natural_spread)
    return SequenceSpec(prompt_tokens, max_tokens, context, cause, sampler)  # type: ignore[arg-type]


def run_closed_loop(config: SimulatorConfig, concurrency: int, requests_per_client: int,
                    prompt_tokens: int = 22, max_tokens: int | None = 128,
                    prompt: str | None = None) -> list[Outcome]:
    """`concurrency` clients each send `requests_per_client` requests one after another, all
    starting at t=0. Without `prompt` every request has its own, so natural lengths vary like
    real ones; with it, all send the same (as the sweep does), so all answers are alike."""
    core = EngineCore(config)
    now = 0.0
    outcomes: list[Outcome] = []
    started: dict[int, tuple[int, float]] = {}  # seq id -> (client, start time)
    remaining = [requests_per_client] * concurrency
    counter = 0

    def send(client: int) -> None:
        nonlocal counter
        while remaining[client] > 0:
            remaining[client] -= 1
            counter += 1
            result = core.submit(spec_for(config, prompt or f"prompt {counter}", prompt_tokens, max_tokens), now)
            if isinstance(result, Rejected):
                outcomes.append(Outcome(None, result, 0.0))
                continue  # a rejected client sends its next request at once
            started[result] = (client, now)
            return

    for client in range(concurrency):
        send(client)
    while not core.idle:
        step = core.step(now)
        now += step.duration_s or IDLE_TICK_S  # nothing ran: let time pass (deadlines)
        for event in step.events:
            if isinstance(event, Output) and event.finish is not None:
                client, start = started.pop(event.seq_id)
                outcomes.append(Outcome(event.finish, None, now - start))
                send(client)
    return outcomes
