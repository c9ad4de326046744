"""The simulated engine as pure logic, on a virtual clock: each mechanism shows its effect at
the concurrency where its budget runs out, and not below it."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.config import ConfigError
from proxy.simulator.engine import EngineCore, Output, Preempted, Rejected, Scheduled, SequenceSpec
from proxy.simulator.sampling import AnswerSampler, estimate_prompt_tokens
from proxy.simulator.settings import SCENARIOS, SimulatorConfig
from proxy.simulator.workload import Outcome, run_closed_loop, spec_for

MAX_TOKENS = 128


def causes(outcomes: list[Outcome]) -> Counter[str]:
    return Counter(o.finish.cause if o.finish else f"rejected_{o.rejected.status}"  # type: ignore[union-attr]
                   for o in outcomes)


def spec(prompt: str = "p", prompt_tokens: int = 22, max_tokens: int | None = MAX_TOKENS,
         config: SimulatorConfig = SCENARIOS["healthy"], stop: tuple[str, ...] = ()) -> SequenceSpec:
    return replace(spec_for(config, prompt, prompt_tokens, max_tokens), stop=stop)


def run_to_end(core: EngineCore, now: float = 0.0) -> tuple[list[Output], float]:
    """Step until idle; the finishing outputs and the virtual time at the end."""
    finished: list[Output] = []
    while not core.idle:
        step = core.step(now)
        now += step.duration_s or 0.001
        finished += [e for e in step.events if isinstance(e, Output) and e.finish is not None]
    return finished, now


# --- the scenarios, as the demo's sweep sees them ----------------------------------------------

@pytest.mark.parametrize("concurrency", [1, 2])
def test_clamp_scenario_lets_one_or_two_answers_end_on_their_own(concurrency: int) -> None:
    assert set(causes(run_closed_loop(SCENARIOS["clamp"], concurrency, 3))) == {"eos"}


@pytest.mark.parametrize("concurrency", [4, 8])
def test_clamp_scenario_cuts_answers_below_the_requested_budget_from_four(concurrency: int) -> None:
    outcomes = run_closed_loop(SCENARIOS["clamp"], concurrency, 3)
    clamped = [o.finish for o in outcomes if o.finish and o.finish.cause == "length_kv_clamp"]
    assert len(clamped) >= len(outcomes) // 3
    assert all(f.reason == "length" and f.completion_tokens < MAX_TOKENS for f in clamped)


@pytest.mark.parametrize("concurrency", [1, 2])
def test_reject_scenario_refuses_nothing_below_its_budget(concurrency: int) -> None:
    assert set(causes(run_closed_loop(SCENARIOS["reject"], concurrency, 3))) == {"eos"}


@pytest.mark.parametrize("concurrency", [4, 8])
def test_reject_scenario_refuses_with_503_from_four(concurrency: int) -> None:
    counted = causes(run_closed_loop(SCENARIOS["reject"], concurrency, 3))
    assert counted["rejected_503"] > 0 and counted["eos"] > 0
    assert set(counted) == {"eos", "rejected_503"}


@pytest.mark.parametrize("concurrency", [1, 2])
def test_preempt_scenario_does_not_preempt_one_or_two(concurrency: int) -> None:
    outcomes = run_closed_loop(SCENARIOS["preempt"], concurrency, 3)
    assert sum(o.finish.preemptions for o in outcomes if o.finish) == 0


@pytest.mark.parametrize("concurrency", [4, 8])
def test_preempt_scenario_completes_every_answer_but_later(concurrency: int) -> None:
    preempted = run_closed_loop(SCENARIOS["preempt"], concurrency, 3)
    healthy = run_closed_loop(SCENARIOS["healthy"], concurrency, 3)
    assert set(causes(preempted)) == {"eos"}
    assert sum(o.finish.preemptions for o in preempted if o.finish) > 0
    # the same answers (same prompts, same seed), only later: virtual time, not a speed test
    assert sorted(o.finish.completion_tokens for o in preempted if o.finish) == \
        sorted(o.finish.completion_tokens for o in healthy if o.finish)
    assert max(o.latency_s for o in preempted) > max(o.latency_s for o in healthy)


@pytest.mark.parametrize("concurrency", [1, 2, 4, 8])
def test_slots_scenario_cuts_long_answers_at_the_slot_context_at_every_concurrency(concurrency: int) -> None:
    config = SCENARIOS["slots"]
    outcomes = run_closed_loop(config, concurrency, 3)
    assert causes(outcomes)["length_slot_ctx"] > 0
    slot_limit = config.ctx_size // config.slots - 22
    assert all(o.finish.completion_tokens <= slot_limit for o in outcomes if o.finish)


@pytest.mark.parametrize("concurrency", [1, 2])
def test_deadline_scenario_lets_one_or_two_answers_finish(concurrency: int) -> None:
    assert set(causes(run_closed_loop(SCENARIOS["deadline"], concurrency, 3))) == {"eos"}


@pytest.mark.parametrize("concurrency", [4, 8])
def test_deadline_scenario_ends_answers_as_if_complete_from_four(concurrency: int) -> None:
    outcomes = run_closed_loop(SCENARIOS["deadline"], concurrency, 3)
    cut = [o.finish for o in outcomes if o.finish and o.finish.cause == "deadline"]
    assert cut and all(f.reason == "stop" and f.stop_reason is None for f in cut)
    natural = {o.finish.completion_tokens for o in run_closed_loop(SCENARIOS["healthy"], concurrency, 3)
               if o.finish}
    assert max(f.completion_tokens for f in cut) < max(natural)


@pytest.mark.parametrize("concurrency", [1, 2, 4, 8])
def test_healthy_scenario_ends_every_answer_on_its_own(concurrency: int) -> None:
    assert set(causes(run_closed_loop(SCENARIOS["healthy"], concurrency, 3))) == {"eos"}


def test_the_default_config_is_the_clamp_scenario() -> None:
    assert SimulatorConfig() == SCENARIOS["clamp"]


# --- the mechanisms one by one -----------------------------------------------------------------

def test_step_time_grows_with_the_batch() -> None:
    config = SimulatorConfig(token_time_s=0.004, batch_slowdown=0.5)
    assert config.step_time_s(1) == pytest.approx(0.004)
    assert config.step_time_s(3) == pytest.approx(0.008)
    core = EngineCore(replace(config, prefill_time_per_token_s=0.0, kv_blocks=0))
    for i in range(3):
        core.submit(spec(f"p{i}"), 0.0)
    assert core.step(0.0).batch == 3
    assert core.step(0.0).duration_s == pytest.approx(0.008)


def test_one_step_gives_every_running_sequence_one_token() -> None:
    core = EngineCore(SCENARIOS["healthy"])
    ids = [core.submit(spec(f"p{i}"), 0.0) for i in range(5)]
    step = core.step(0.0)
    assert [e.seq_id for e in step.events if isinstance(e, Scheduled)] == ids
    assert [e.seq_id for e in step.events if isinstance(e, Output)] == ids


def test_an_answer_ends_with_an_empty_eos_token_after_its_natural_length() -> None:
    core = EngineCore(SCENARIOS["healthy"])
    one = spec("why", max_tokens=None)
    core.submit(one, 0.0)
    (out,), _ = run_to_end(core)
    assert out.text == "" and out.finish is not None
    assert (out.finish.reason, out.finish.cause) == ("stop", "eos")
    assert out.finish.completion_tokens == one.sampler.natural_tokens + 1  # EOS counts, as in vLLM


def test_a_budget_below_the_natural_length_ends_with_length_requested() -> None:
    core = EngineCore(SCENARIOS["healthy"])
    core.submit(spec(max_tokens=5), 0.0)
    (out,), _ = run_to_end(core)
    assert out.finish is not None
    assert (out.finish.reason, out.finish.cause, out.finish.completion_tokens) == ("length", "length_requested", 5)
    assert out.text != ""  # the last token's text comes with the finish, as vLLM sends it


def test_clamp_splits_the_free_blocks_among_the_requests_waiting_for_them() -> None:
    config = SimulatorConfig(kv_blocks=24, block_size=16, kv_policy="clamp", natural_tokens=300)
    core = EngineCore(config)
    for i in range(4):
        core.submit(spec(f"p{i}", config=config), 0.0)  # arriving together: 6 blocks each
    finishes = [o.finish for o in run_to_end(core)[0]]
    assert {(f.reason, f.cause, f.completion_tokens) for f in finishes if f} == \
        {("length", "length_kv_clamp", 6 * 16 - 22)}


def test_clamp_leaves_the_full_budget_while_two_requests_share_the_cache() -> None:
    config = SimulatorConfig(kv_blocks=24, block_size=16, kv_policy="clamp", natural_tokens=300)
    core = EngineCore(config)
    for i in range(2):
        core.submit(spec(f"p{i}", config=config), 0.0)
    finishes = [o.finish for o in run_to_end(core)[0]]
    assert {(f.cause, f.completion_tokens) for f in finishes if f} == {("length_requested", MAX_TOKENS)}


def test_clamp_gives_a_late_request_what_the_others_left() -> None:
    config = SimulatorConfig(kv_blocks=24, block_size=16, kv_policy="clamp", natural_tokens=300)
    core = EngineCore(config)
    for i in range(3):
        core.submit(spec(f"p{i}", config=config), 0.0)  # 22 + 128 tokens = 10 blocks each
        core.step(0.0)
    finishes = {o.seq_id: o.finish for o in run_to_end(core)[0]}
    assert finishes[1].cause == finishes[2].cause == "length_requested"  # type: ignore[union-attr]
    third = finishes[3]
    assert third is not None and third.cause == "length_kv_clamp" and third.reason == "length"
    assert third.completion_tokens == 4 * 16 - 22  # the 4 blocks that were left


def test_clamp_makes_a_request_wait_when_not_one_token_fits() -> None:
    config = SimulatorConfig(kv_blocks=20, block_size=16, kv_policy="clamp")
    core = EngineCore(config)
    for i in range(3):
        core.submit(spec(f"p{i}", config=config), 0.0)
        core.step(0.0)
    assert (core.num_running, core.num_waiting) == (2, 1)
    finished, _ = run_to_end(core)
    assert len(finished) == 3


@pytest.mark.parametrize("prompt_tokens", [5, 16, 31, 48, 64])
@pytest.mark.parametrize("prompt", ["a", "b", "c"])
def test_the_kv_presets_show_their_effect_for_any_short_prompt(prompt_tokens: int, prompt: str) -> None:
    """As the sweep sends them: one prompt for every request, so every answer is alike."""
    for name in ("clamp", "reject", "deadline"):
        cut = [any(o.finish is None or o.finish.cause != "eos"
                   for o in run_closed_loop(SCENARIOS[name], c, 2, prompt_tokens, prompt=prompt))
               for c in (1, 2, 4, 8)]
        assert cut == [False, False, True, True], name
    preempted = [sum(o.finish.preemptions for o in run_closed_loop(SCENARIOS["preempt"], c, 2, prompt_tokens,
                                                                   prompt=prompt) if o.finish)
                 for c in (1, 2, 4, 8)]
    assert preempted[:2] == [0, 0] and min(preempted[2:]) > 0


def test_reject_refuses_at_submission_with_the_configured_status() -> None:
    config = SimulatorConfig(kv_blocks=24, kv_policy="reject", reject_status=429)
    core = EngineCore(config)
    assert isinstance(core.submit(spec("a", config=config), 0.0), int)
    assert isinstance(core.submit(spec("b", config=config), 0.0), int)
    refused = core.submit(spec("c", config=config), 0.0)
    assert isinstance(refused, Rejected)
    assert (refused.status, refused.kind) == (429, "kv_full")
    assert core.counters.rejected == 1


def test_preempt_pauses_the_newest_sequence_and_later_recomputes_it() -> None:
    config = SimulatorConfig(kv_blocks=6, block_size=16, kv_policy="preempt", natural_tokens=60)
    core = EngineCore(config)
    for i in range(2):
        core.submit(spec(f"p{i}", config=config, max_tokens=None), 0.0)
    events: list[object] = []
    now = 0.0
    while not core.idle:
        step = core.step(now)
        now += step.duration_s or 0.001
        events += step.events
        assert core.used_blocks <= config.kv_blocks
    preempted = [e for e in events if isinstance(e, Preempted)]
    assert preempted and all(e.seq_id == 2 for e in preempted)
    assert [e.seq_id for e in events if isinstance(e, Scheduled)].count(2) == len(preempted) + 1
    finishes = [e.finish for e in events if isinstance(e, Output) and e.finish]
    assert {f.cause for f in finishes} == {"eos"} and core.counters.preemptions == len(preempted)


def test_a_request_larger_than_the_whole_cache_is_capped_at_the_kv_capacity() -> None:
    config = SimulatorConfig(kv_blocks=4, block_size=16, kv_policy="preempt", natural_tokens=200)
    core = EngineCore(config)
    core.submit(spec(config=config, max_tokens=None), 0.0)
    (out,), _ = run_to_end(core)
    assert out.finish is not None and out.finish.cause == "length_kv_capacity"
    assert out.finish.completion_tokens == 64 - 22


def test_a_prompt_longer_than_the_context_is_refused_with_400() -> None:
    core = EngineCore(SimulatorConfig(ctx_size=32, kv_blocks=0, kv_policy="none"))
    refused = core.submit(replace(spec(prompt_tokens=40), context_tokens=32), 0.0)
    assert isinstance(refused, Rejected) and refused.status == 400 and refused.kind == "prompt_too_long"


def test_slots_make_requests_beyond_them_wait() -> None:
    config = SimulatorConfig(kv_blocks=0, kv_policy="none", slots=2, ctx_size=256)
    core = EngineCore(config)
    for i in range(3):
        core.submit(spec(f"p{i}", config=config), 0.0)
    core.step(0.0)
    assert (core.num_running, core.num_waiting) == (2, 1)


def test_slot_context_counts_prompt_and_answer() -> None:
    config = SimulatorConfig(kv_blocks=0, kv_policy="none", slots=4, ctx_size=256, natural_tokens=500)
    core = EngineCore(config)
    core.submit(spec(config=config, prompt_tokens=30, max_tokens=None), 0.0)
    (out,), _ = run_to_end(core)
    assert out.finish is not None and out.finish.cause == "length_slot_ctx"
    assert out.finish.completion_tokens == 256 // 4 - 30


def test_the_deadline_ends_a_running_answer_as_stop_without_a_token() -> None:
    config = SimulatorConfig(kv_blocks=0, kv_policy="none", deadline_s=0.1, token_time_s=0.01,
                             natural_tokens=100, natural_spread=0.0)
    core = EngineCore(config)
    core.submit(spec(config=config), 0.0)
    (out,), end = run_to_end(core)
    assert out.finish is not None and (out.finish.reason, out.finish.cause) == ("stop", "deadline")
    assert out.token is False and out.text == ""
    assert 5 <= out.finish.completion_tokens <= 11 and end == pytest.approx(0.1, abs=0.02)


def test_the_deadline_also_ends_requests_still_waiting() -> None:
    config = SimulatorConfig(kv_blocks=0, kv_policy="none", slots=1, ctx_size=4096, deadline_s=0.05,
                             token_time_s=0.01)
    core = EngineCore(config)
    core.submit(spec("a", config=config), 0.0)
    core.submit(spec("b", config=config), 0.0)
    finished, _ = run_to_end(core)
    waiting = next(o for o in finished if o.seq_id == 2)
    assert waiting.finish is not None and waiting.finish.cause == "deadline"
    assert waiting.finish.completion_tokens == 0


def test_a_stop_string_ends_the_answer_and_is_left_out_of_the_text() -> None:
    probe = EngineCore(SCENARIOS["healthy"])
    probe.submit(spec("s", max_tokens=None), 0.0)
    texts = []
    while not probe.idle:
        texts += [e.text for e in probe.step(0.0).events if isinstance(e, Output)]
    stop_word = texts[5].strip()
    core = EngineCore(SCENARIOS["healthy"])
    core.submit(spec("s", max_tokens=None, stop=(stop_word,)), 0.0)
    outputs: list[Output] = []
    while not core.idle:
        outputs += [e for e in core.step(0.0).events if isinstance(e, Output)]
    last = outputs[-1]
    assert last.finish is not None and last.finish.cause == "stop_sequence"
    assert last.finish.reason == "stop" and last.finish.stop_reason == stop_word
    assert stop_word not in "".join(o.text for o in outputs)
    assert len(outputs) <= 6


def test_abort_frees_the_blocks_of_a_sequence() -> None:
    config = SimulatorConfig(kv_blocks=24, kv_policy="clamp")
    core = EngineCore(config)
    seq_id = core.submit(spec(config=config), 0.0)
    core.step(0.0)
    assert core.used_blocks > 0 and isinstance(seq_id, int)
    assert core.abort(seq_id) and core.used_blocks == 0 and core.idle
    assert not core.abort(seq_id)


# --- seeded answers ----------------------------------------------------------------------------

def test_the_same_seed_and_prompt_give_the_same_answer() -> None:
    def answer(seed: int, prompt: str) -> tuple[int, str]:
        sampler = AnswerSampler(seed, prompt, 80, 0.25)
        return sampler.natural_tokens, "".join(sampler.next_token() for _ in range(20))

    assert answer(7, "hello") == answer(7, "hello")
    assert {answer(seed, "hello") for seed in range(8)} != {answer(7, "hello")}


@given(st.integers(min_value=0, max_value=2**63), st.text(max_size=50),
       st.integers(min_value=1, max_value=500), st.floats(min_value=0, max_value=0.99))
def test_natural_lengths_stay_within_the_spread(seed: int, prompt: str, mean: int, spread: float) -> None:
    natural = AnswerSampler(seed, prompt, mean, spread).natural_tokens
    assert max(1, mean * (1 - spread) - 1) <= natural <= mean * (1 + spread) + 1


def test_prompt_tokens_are_estimated_at_four_characters_each() -> None:
    assert (estimate_prompt_tokens(""), estimate_prompt_tokens("abc"), estimate_prompt_tokens("a" * 9)) == (0, 1, 3)


# --- invariants --------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(["clamp", "preempt", "reject", "none"]), blocks=st.integers(8, 40),
       concurrency=st.integers(1, 10), max_tokens=st.one_of(st.none(), st.integers(1, 200)),
       prompt_tokens=st.integers(1, 100))
def test_blocks_never_exceed_the_cache_and_all_return_at_the_end(
        policy: str, blocks: int, concurrency: int, max_tokens: int | None, prompt_tokens: int) -> None:
    config = SimulatorConfig(kv_blocks=blocks, kv_policy=policy, natural_tokens=60,  # type: ignore[arg-type]
                             token_time_s=0.001)
    core = EngineCore(config)
    accepted = 0
    for i in range(concurrency):
        if isinstance(core.submit(spec(f"p{i}", prompt_tokens, max_tokens, config), 0.0), int):
            accepted += 1
    finished = 0
    now = 0.0
    for _ in range(100_000):
        if core.idle:
            break
        step = core.step(now)
        now += step.duration_s or 0.001
        finished += sum(1 for e in step.events if isinstance(e, Output) and e.finish is not None)
        if policy != "none":
            assert core.used_blocks <= blocks
    assert core.idle and finished == accepted and core.used_blocks == 0


def test_invalid_configs_are_refused_with_a_message() -> None:
    with pytest.raises(ConfigError, match="kv_policy"):
        SimulatorConfig(kv_policy="drop")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="token_time_s"):
        SimulatorConfig(token_time_s=-1)
    with pytest.raises(ConfigError, match="reject_status"):
        SimulatorConfig(reject_status=500)
