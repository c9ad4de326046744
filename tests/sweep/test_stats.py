"""The sweep's pure statistics: quantiles, the bootstrap interval, per-level summaries."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.sweep.stats import (
    bootstrap_mean_difference,
    by_level,
    is_complete,
    output_tokens,
    quantile,
    stop_label,
    summarize,
    summarize_level,
)
from tests.support.sweep_samples import level, sample


@pytest.mark.parametrize(("values", "q", "expected"), [
    ([1.0], 0.5, 1.0),
    ([1.0, 2.0, 3.0, 4.0], 0.5, 2.5),
    ([1.0, 2.0, 3.0, 4.0], 0.25, 1.75),
    ([4.0, 1.0, 3.0, 2.0], 0.75, 3.25),
    ([1.0, 2.0, 3.0, 4.0], 0.0, 1.0),
    ([1.0, 2.0, 3.0, 4.0], 1.0, 4.0),
    ([10.0, 20.0], 0.95, 19.5),
])
def test_quantile_interpolates_linearly_between_order_statistics(values: list[float], q: float,
                                                                 expected: float) -> None:
    assert quantile(values, q) == pytest.approx(expected)


def test_quantile_of_nothing_is_none() -> None:
    assert quantile([], 0.5) is None


def test_stop_label_splits_length_by_its_cause() -> None:
    assert stop_label(sample(1, stop="length", length_cause="server_limit").record) == "length:server_limit"
    assert stop_label(sample(1, stop="length", length_cause="requested_budget").record) == \
        "length:requested_budget"
    assert stop_label(sample(1, stop="length").record) == "length"
    assert stop_label(sample(1, stop="rejected").record) == "rejected"


def test_complete_means_the_answer_ended_on_its_own() -> None:
    for stop in ("eos", "stop_sequence", "tool_calls"):
        assert is_complete(sample(1, stop=stop).record)
    for stop in ("length", "deadline", "rejected", "upstream_error", "client_disconnect", "unknown"):
        assert not is_complete(sample(1, stop=stop).record)


def test_a_response_without_a_token_count_counts_as_zero_tokens() -> None:
    assert output_tokens(sample(1, tokens=None, stop="rejected").record) == 0


def test_bootstrap_interval_of_identical_groups_is_zero() -> None:
    interval = bootstrap_mean_difference([5.0] * 6, [5.0] * 6)
    assert interval is not None
    assert (interval.estimate, interval.low, interval.high) == (0.0, 0.0, 0.0)
    assert not interval.excludes_zero()


def test_bootstrap_interval_of_a_clear_drop_lies_below_zero_and_holds_the_estimate() -> None:
    interval = bootstrap_mean_difference([100.0, 102.0, 98.0, 101.0], [50.0, 52.0, 49.0, 51.0])
    assert interval is not None
    assert interval.estimate == pytest.approx(-49.75)
    assert interval.low <= interval.estimate <= interval.high < 0
    assert interval.excludes_zero()


def test_bootstrap_is_deterministic_for_a_seed() -> None:
    a, b = [1.0, 5.0, 9.0, 3.0], [2.0, 8.0, 4.0]
    assert bootstrap_mean_difference(a, b) == bootstrap_mean_difference(a, b)


def test_bootstrap_of_an_empty_group_is_none() -> None:
    assert bootstrap_mean_difference([], [1.0]) is None


def test_level_summary_counts_stops_completion_and_telemetry() -> None:
    samples = [
        sample(4, 0, tokens=100, duration=1.0, kv_cache_usage_max=0.5, vram_free_min_bytes=3 * 2**30,
               preemptions_during=0.0),
        sample(4, 1, tokens=40, stop="length", length_cause="server_limit", duration=0.5,
               kv_cache_usage_max=0.9, vram_free_min_bytes=2**30, preemptions_during=2.0),
        sample(4, 2, tokens=None, stop="rejected", status=429, duration=0.01),
        sample(4, 3, tokens=100, deadline_hit="total", client_disconnected=True, duration=2.0),
        sample(4, 4, tokens=0, stop="upstream_error", upstream_error="oom", status=500),
    ]
    s = summarize_level(4, samples)
    assert (s.n, s.complete, s.completion_rate) == (5, 2, 0.4)
    assert s.stop_counts == {"eos": 2, "length:server_limit": 1, "rejected": 1, "upstream_error": 1}
    assert (s.output_tokens_median, s.output_tokens_q1, s.output_tokens_q3) == (40, 0, 100)
    assert s.output_tokens_mean == pytest.approx(48.0)
    assert (s.deadline_hits, s.client_disconnects, s.server_errors) == (1, 1, 1)
    assert (s.preempted_responses, s.preemptions_max) == (1, 2.0)
    assert s.vram_free_min_bytes == 2**30 and s.kv_cache_usage_max == 0.9
    assert s.requested_max_tokens == 200 and s.duration_max_s == 2.0
    assert s.joined == 5


def test_level_summary_says_none_where_no_response_carried_a_figure() -> None:
    s = summarize_level(1, level(1, 3))
    assert s.vram_free_min_bytes is None and s.kv_cache_usage_max is None
    assert s.preempted_responses is None and s.preemptions_max is None


def test_summaries_come_lowest_level_first() -> None:
    samples = level(8, 2) + level(1, 2) + level(2, 2)
    assert [s.level for s in summarize(samples)] == [1, 2, 8]
    assert list(by_level(samples)) == [1, 2, 8]


def test_summary_of_no_responses_is_an_error() -> None:
    with pytest.raises(ValueError, match="no responses"):
        summarize_level(2, [])


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=30), st.floats(0, 1), st.floats(0, 1))
def test_quantile_lies_within_the_data_and_grows_with_q(values: list[float], q1: float, q2: float) -> None:
    low, high = sorted((q1, q2))
    a, b = quantile(values, low), quantile(values, high)
    assert a is not None and b is not None
    assert min(values) <= a <= b <= max(values)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 500), min_size=1, max_size=12), st.lists(st.integers(0, 500), min_size=1,
       max_size=12), st.integers(-100, 100))
def test_bootstrap_interval_is_ordered_and_shifts_with_the_data(a: list[int], b: list[int], shift: int) -> None:
    base = bootstrap_mean_difference([float(x) for x in a], [float(x) for x in b], resamples=200)
    moved = bootstrap_mean_difference([float(x) for x in a], [float(x + shift) for x in b], resamples=200)
    assert base is not None and moved is not None
    assert base.low <= base.high
    assert moved.estimate == pytest.approx(base.estimate + shift, abs=1e-6)
    assert moved.low == pytest.approx(base.low + shift, abs=1e-6)
    assert moved.high == pytest.approx(base.high + shift, abs=1e-6)


STOPS = ("eos", "stop_sequence", "length", "deadline", "rejected", "upstream_error", "client_disconnect")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(STOPS), st.integers(0, 300) | st.none()), min_size=1, max_size=20))
def test_a_level_summary_accounts_for_every_response(responses: list[tuple[str, int | None]]) -> None:
    samples = [sample(2, i, stop=stop, tokens=tokens) for i, (stop, tokens) in enumerate(responses)]
    s = summarize_level(2, samples)
    assert s.n == len(responses) == sum(s.stop_counts.values())
    assert s.complete == sum(1 for stop, _ in responses if stop in ("eos", "stop_sequence"))
    assert s.completion_rate == s.complete / s.n
    assert s.output_tokens_q1 <= s.output_tokens_median <= s.output_tokens_q3


def test_throughput_and_latency_come_from_the_clients_clock_over_the_levels_wall_time() -> None:
    samples = level(2, 4, tokens=100)
    for s, (sent, took) in zip(samples, [(0.0, 1.0), (0.0, 2.0), (1.0, 1.0), (2.0, 2.0)], strict=True):
        s.client.sent_s, s.client.duration_s = sent, took
    summary = summarize_level(2, samples)
    assert summary.wall_s == 4.0  # first sent at 0, last ended at 2 + 2
    assert (summary.output_tokens_per_s, summary.requests_per_s) == (100.0, 1.0)
    assert (summary.latency_p50_s, summary.latency_p99_s) == (1.5, pytest.approx(2.0))
    assert summary.latency_p95_s == pytest.approx(2.0)


def test_without_a_client_clock_the_records_give_wall_time_and_latency() -> None:
    samples = level(1, 3, tokens=10, duration=2.0)  # records rebuilt from history carry no client measure
    for i, s in enumerate(samples):
        s.record.started_at = 100.0 + 2.0 * i
    summary = summarize_level(1, samples)
    assert summary.wall_s == 6.0 and summary.requests_per_s == 0.5 and summary.output_tokens_per_s == 5.0
    assert summary.latency_p50_s == 2.0


def test_a_level_with_no_measurable_wall_time_has_no_rates() -> None:
    summary = summarize_level(1, level(1, 2, duration=0.0))
    assert summary.wall_s is None and summary.output_tokens_per_s is None and summary.requests_per_s is None


def test_the_completion_interval_is_wilsons_and_stays_inside_0_and_1() -> None:
    from proxy.sweep.stats import wilson

    assert wilson(0, 0) == (0.0, 1.0)
    low, high = wilson(10, 10)
    assert high == pytest.approx(1.0) and 0.69 < low < 0.73  # 10 of 10: [72.2%, 100%]
    low, high = wilson(3, 12)
    assert 0.08 < low < 0.09 and 0.53 < high < 0.54
    summary = summarize_level(1, level(1, 4) + [sample(1, 9, stop="length", length_cause="server_limit")])
    assert summary.completion_low is not None and summary.completion_low < 0.8 < summary.completion_high  # type: ignore[operator]


def test_large_groups_get_the_normal_interval_and_it_agrees_with_the_bootstrap() -> None:
    from proxy.sweep.stats import LARGE_SAMPLE

    rng = random.Random(7)
    a = [float(256 if rng.random() < 0.9 else rng.randint(20, 200)) for _ in range(LARGE_SAMPLE)]
    b = [float(256 if rng.random() < 0.8 else rng.randint(20, 200)) for _ in range(LARGE_SAMPLE)]
    normal = bootstrap_mean_difference(a, b)
    boot = bootstrap_mean_difference(a[:-1], b, resamples=2000)  # one short: the bootstrap
    assert normal is not None and boot is not None
    assert normal.method.startswith("normal") and boot.method.startswith("percentile bootstrap")
    assert normal.excludes_zero() and boot.excludes_zero()
    width = normal.high - normal.low
    assert abs(normal.low - boot.low) < 0.1 * width and abs(normal.high - boot.high) < 0.1 * width
    same = bootstrap_mean_difference(a, list(a))
    assert same is not None and not same.excludes_zero()
