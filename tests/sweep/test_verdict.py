"""Each verdict rule on records built for it: the kind, the cause it names, and the numbers it shows."""

from __future__ import annotations

from proxy.sweep.sample import Sample
from proxy.sweep.stats import by_level, summarize
from proxy.sweep.verdict import Verdict, decide
from tests.support.sweep_samples import level, sample


def verdict(samples: list[Sample], client_timeout_s: float | None = None) -> Verdict:
    return decide(summarize(samples), by_level(samples), client_timeout_s=client_timeout_s)


def healthy(levels: tuple[int, ...] = (1, 2, 4, 8), n: int = 4) -> list[Sample]:
    return [s for c in levels for s in level(c, c * n, duration=1.0 + 0.1 * c)]


def test_one_level_is_not_enough_to_compare() -> None:
    v = verdict(level(1, 5))
    assert v.kind == "insufficient_data"


def test_stable_complete_answers_with_growing_latency_show_no_load_effect() -> None:
    v = verdict(healthy())
    assert v.kind == "no_load_effect" and v.cause is None and not v.inferred
    assert v.length_difference is not None and v.length_difference.estimate == 0.0
    assert "--repeats" in v.recommendation
    assert any("TTFT p50 50 ms at c=1 -> 400 ms at c=8" in line for line in v.evidence)
    assert any("95% CI" in line for line in v.evidence)


def test_preemptions_with_complete_answers_are_reported_but_not_truncation() -> None:
    samples = healthy((1, 2, 4)) + level(8, 16, preemptions_during=3.0, kv_cache_usage_max=0.97)
    v = verdict(samples)
    assert v.kind == "no_load_effect"
    assert any("preempted during 16 response(s) at c=8" in line for line in v.evidence)
    assert any("c=8: 97%" in line for line in v.evidence)


def test_server_token_limit_under_load_is_a_serving_defect_naming_server_limit() -> None:
    cut = {"stop": "length", "length_cause": "server_limit", "tokens": 32, "finish_reason_raw": "length"}
    samples = level(1, 4) + level(2, 8) + level(4, 8) + level(4, 8, **cut) + level(8, 32, **cut)
    v = verdict(samples)
    assert (v.kind, v.cause, v.onset_level) == ("serving_defect", "length:server_limit", 4)
    assert "before the requested budget of 200 tokens" in v.headline
    assert any("stopped at 32 output tokens though 200 were requested" in line for line in v.evidence)
    assert any("c=4: 50% (8/16)" in line for line in v.evidence)


def test_oom_errors_under_load_are_a_serving_defect_naming_upstream_error() -> None:
    oom = {"stop": "upstream_error", "upstream_error": "oom", "tokens": 0, "status": 500,
           "upstream_error_detail": "CUDA out of memory"}
    samples = level(1, 4) + level(2, 8) + level(4, 12) + level(4, 4, **oom)
    v = verdict(samples)
    assert (v.kind, v.cause, v.onset_level) == ("serving_defect", "upstream_error", 4)
    assert any("oom x4" in line and "CUDA out of memory" in line for line in v.evidence)


def test_rejections_from_a_level_are_an_admission_policy_with_its_onset() -> None:
    rejected = {"stop": "rejected", "status": 429, "tokens": None, "duration": 0.01}
    samples = level(1, 4) + level(2, 8) + level(4, 16) + level(8, 16) + level(8, 16, **rejected)
    v = verdict(samples)
    assert (v.kind, v.cause, v.onset_level) == ("policy", "rejected", 8)
    assert "admission control" in v.headline
    assert any("429 x16" in line for line in v.evidence)
    assert "below 8 concurrent requests" in v.recommendation


def test_enforced_deadline_is_a_policy_with_the_durations_where_it_cuts() -> None:
    cut = {"stop": "deadline", "deadline_hit": "total", "duration": 5.0, "tokens": 50}
    samples = level(1, 4, duration=3.0) + level(2, 8, duration=4.0) + level(4, 16, **cut)
    v = verdict(samples)
    assert (v.kind, v.cause, v.onset_level) == ("policy", "deadline", 4)
    assert "the proxy's enforced total deadline (--deadline)" in v.headline
    assert any("lasted 5.00 s-5.00 s (median 5.00 s)" in line for line in v.evidence)


def test_idle_timeout_is_named_as_the_idle_timeout_policy() -> None:
    cut = {"stop": "idle_timeout", "deadline_hit": "idle", "itl_max_s": 2.5}
    v = verdict(level(1, 4) + level(4, 12) + level(4, 4, **cut))
    assert (v.kind, v.cause) == ("policy", "idle_timeout")
    assert any("longest gap between chunks median 2.50 s" in line for line in v.evidence)


def test_the_clients_own_timeout_is_named_with_its_value() -> None:
    cut = {"stop": "client_disconnect", "client_disconnected": True, "duration": 30.0}
    v = verdict(level(1, 4) + level(8, 16, **cut), client_timeout_s=30.0)
    assert (v.kind, v.cause) == ("policy", "client_disconnect")
    assert "the client's timeout of 30 s" in v.headline


def test_one_odd_cut_response_is_not_a_pattern() -> None:
    samples = level(1, 2) + level(2, 3) + [sample(2, 9, stop="upstream_disconnect")]
    assert verdict(samples).kind == "no_load_effect"


def test_the_dominant_cause_wins_and_the_others_are_listed() -> None:
    samples = (level(1, 4) + level(4, 10) + level(4, 4, stop="upstream_disconnect")
               + level(4, 2, stop="upstream_error", upstream_error="reset"))
    v = verdict(samples)
    assert v.cause == "upstream_disconnect"
    assert any(line == "other causes: upstream_error 2" for line in v.evidence)


def test_shorter_complete_answers_with_durations_at_one_value_are_an_inferred_wall_clock_cap() -> None:
    samples = (level(1, 4, tokens=120, duration=1.2) + level(2, 8, tokens=120, duration=1.9)
               + [sample(4, i, tokens=60 + i, duration=2.0 + 0.01 * (i % 3)) for i in range(16)]
               + [sample(8, i, tokens=30 + i % 5, duration=2.0 - 0.01 * (i % 2)) for i in range(32)])
    v = verdict(samples)
    assert (v.kind, v.cause, v.onset_level, v.inferred) == ("hidden_cap", "wall_clock_cap", 4, True)
    assert "about 2.00 s" in v.headline and "claims to be complete" in v.headline
    assert any("48 of 48 responses at concurrency >= 4" in line for line in v.evidence)
    assert any("inferred" in line for line in v.evidence)
    assert v.length_difference is not None and v.length_difference.high < 0
    assert "inferred" in v.text().splitlines()[0]


def test_shorter_complete_answers_without_a_duration_cluster_are_a_length_shift_not_a_cap() -> None:
    samples = (level(1, 4, tokens=120, duration=1.2)
               + [sample(4, i, tokens=50 + i, duration=0.5 + 0.3 * i) for i in range(16)])
    v = verdict(samples)
    assert (v.kind, v.cause, v.inferred) == ("length_shift", None, True)


def test_a_small_length_wobble_is_not_a_fall() -> None:
    samples = level(1, 4, tokens=100) + [sample(8, i, tokens=95 + i % 3) for i in range(32)]
    assert verdict(samples).kind == "no_load_effect"


def test_answers_at_the_requested_budget_already_at_the_baseline_ask_for_a_larger_budget() -> None:
    budget = {"stop": "length", "length_cause": "requested_budget", "tokens": 200}
    v = verdict(level(1, 4, **budget) + level(4, 16, **budget))
    assert (v.kind, v.cause) == ("baseline_truncation", "length:requested_budget")
    assert "raise --max-tokens above 200" in v.recommendation


def test_failures_already_at_concurrency_one_are_not_called_a_load_effect() -> None:
    v = verdict(level(1, 4, stop="upstream_error", tokens=0) + level(2, 8, stop="upstream_error", tokens=0))
    assert (v.kind, v.cause) == ("baseline_truncation", "upstream_error")
    assert "not a load effect" in v.recommendation


def test_complete_answers_past_an_observed_deadline_are_a_deadline_policy() -> None:
    samples = level(1, 4) + level(4, 16) + level(8, 24, deadline_hit="total", deadline_mode="observe")
    v = verdict(samples)
    assert (v.kind, v.cause, v.onset_level) == ("policy", "deadline_observed", 8)
    assert any("24 of 24 responses at concurrency 8 passed the deadline" in line for line in v.evidence)


def test_verdict_text_has_headline_evidence_and_recommendation() -> None:
    text = verdict(healthy()).text().splitlines()
    assert text[0].startswith("VERDICT (no_load_effect): ")
    assert all(line.startswith("  - ") for line in text[1:-1])
    assert text[-1].startswith("  => ")


def test_a_budget_spent_on_reasoning_is_named_in_the_verdict() -> None:
    from proxy.sweep.stats import by_level, summarize
    from proxy.sweep.table import render
    from tests.support.sweep_samples import level

    thinking = {"stop": "length", "length_cause": "requested_budget", "tokens": 200, "reasoning_tokens": 190,
                "visible_tokens": 10, "reasoning_share": 0.95}
    samples = level(1, 3, **thinking) + level(4, 6, **thinking)
    summaries = summarize(samples)
    v = decide(summaries, by_level(samples))
    assert (v.kind, v.cause) == ("baseline_truncation", "length:requested_budget")
    assert any("3 of 3 of these spent most of the budget on reasoning (median 95% of it)" in line
               for line in v.evidence), v.evidence
    assert "goes mostly to reasoning" in v.recommendation
    assert summaries[0].reasoning_heavy == 3 and "95%" in render(summaries)


def test_answers_past_the_servers_context_are_named_a_context_shift() -> None:
    from proxy.servers.base import ServerInfo
    from proxy.sweep.stats import by_level, summarize
    from tests.support.sweep_samples import level

    samples = level(1, 3, prompt_tokens=200, tokens=100) + level(4, 6, prompt_tokens=200, tokens=100)
    v = decide(summarize(samples), by_level(samples), server=ServerInfo("llama.cpp GET /props", 256, 1))
    assert v.kind == "no_load_effect"
    assert any("9 of 9 answers ran past the 256-token context the server says a request gets (prompt + output "
               "up to 300): it shifted the context" in line for line in v.evidence), v.evidence


def test_prompts_cut_from_a_concurrency_on_are_a_serving_defect_though_every_answer_ended_by_eos() -> None:
    cut = {"prompt_truncated": True, "prompt_tokens": 1026, "context_tokens": 2048,
           "prompt_truncated_detail": "the server evaluated 1,026 prompt tokens (context 2,048 tokens), while the "
                                      "user's turns alone hold 9,000 words, each at least one token: it cut the prompt"}
    samples = level(1, 4) + level(2, 8) + level(4, 4) + level(4, 12, **cut) + level(8, 32, **cut)
    v = verdict(samples)
    assert (v.kind, v.cause, v.onset_level) == ("serving_defect", "prompt_truncated", 4)
    assert v.headline.startswith("prompts are cut on the way in from concurrency 4")
    assert any("evaluated 1026 prompt tokens" in line and "context 2,048" in line for line in v.evidence)
    assert any("OLLAMA_NUM_PARALLEL" in line for line in v.evidence)
    assert "num_ctx" in v.recommendation and "concurrency below 4" in v.recommendation


def test_prompts_cut_already_alone_are_a_baseline_not_a_load_effect() -> None:
    cut = {"prompt_truncated": True, "prompt_tokens": 130, "context_tokens": 256}
    v = verdict(level(1, 4, **cut) + level(2, 8, **cut))
    assert (v.kind, v.cause) == ("baseline_truncation", "prompt_truncated")
    assert "not a load effect" in v.recommendation
    assert not any("OLLAMA_NUM_PARALLEL" in line for line in v.evidence)


def test_a_chat_with_no_user_turn_is_named_with_what_to_send() -> None:
    nothing = {"stop": "not_generated", "tokens": 0, "user_turn": False, "finish_reason_raw": "load",
               "stop_detail": "the server generated nothing (done_reason 'load'): the chat has no user turn"}
    v = verdict(level(1, 4, **nothing) + level(2, 8, **nothing))
    assert (v.kind, v.cause) == ("baseline_truncation", "not_generated:no_user_turn")
    assert "the chat has no user turn" in v.headline
    assert any("never generated: the server generated nothing" in line for line in v.evidence)
    assert v.recommendation.startswith("send at least one user turn")


def test_a_budget_spent_thinking_says_the_answer_got_nothing() -> None:
    thought = {"stop": "length", "length_cause": "requested_budget", "tokens": 200, "reasoning_tokens": 200,
               "visible_tokens": 0, "reasoning_share": 1.0}
    v = verdict(level(1, 4, **thought) + level(2, 8, **thought))
    assert (v.kind, v.cause) == ("baseline_truncation", "length:requested_budget")
    assert any("4 of them showed no answer at all: the answer budget went to thinking" in line for line in v.evidence)
    assert "mostly to reasoning" in v.recommendation


def test_a_load_effect_on_top_of_a_budget_baseline_is_named_with_its_onset() -> None:
    """As against llama.cpp with one slot: every answer stops at the client's budget, and from
    concurrency 4 most clients give up on their timeout."""
    budget = {"stop": "length", "tokens": 200, "length_cause": "requested_budget"}
    groups = {1: level(1, 4, **budget), 2: level(2, 8, **budget),
              4: [*level(4, 2, **budget), *[sample(4, 2 + i, stop="client_disconnect", duration=30.0, tokens=40)
                                            for i in range(6)]],
              8: [*level(8, 1, **budget), *[sample(8, 1 + i, stop="client_disconnect", duration=30.0, tokens=20)
                                            for i in range(7)]]}
    verdict = decide(summarize([s for g in groups.values() for s in g]), groups, client_timeout_s=30.0)
    assert (verdict.kind, verdict.cause, verdict.onset_level) == ("policy", "client_disconnect", 4)
    assert verdict.baseline is not None and "ran into the client's own budget" in verdict.baseline
    assert "the client's timeout of 30 s ends answers from concurrency 4" in verdict.headline
    assert "raise --max-tokens above 200" in verdict.recommendation
    assert "client_disconnect by concurrency: c=1: 0/4, c=2: 0/8, c=4: 6/8, c=8: 7/8 (it comes with load)" in (
        verdict.evidence)
    text = verdict.text()
    assert "and at every level, the baseline:" in text


def test_a_baseline_that_does_not_change_with_load_stays_a_baseline() -> None:
    budget = {"stop": "length", "tokens": 200, "length_cause": "requested_budget"}
    groups = {1: level(1, 4, **budget), 4: level(4, 8, **budget)}
    verdict = decide(summarize([s for g in groups.values() for s in g]), groups)
    assert verdict.kind == "baseline_truncation" and verdict.baseline is None


def test_the_proxys_own_failures_are_named_as_the_proxys_not_the_servers() -> None:
    failed = {"stop": "proxy_error", "tokens": 3}
    samples = level(1, 4) + level(2, 8) + level(4, 4) + level(4, 12, **failed)
    v = verdict(samples)
    assert v.cause == "proxy_error"
    assert "a defect of llm-diag-proxy, not of the server" in v.headline
    assert "exchange_failed" in v.recommendation
    assert "concurrency" not in v.recommendation and "--max-in-flight" not in v.recommendation
