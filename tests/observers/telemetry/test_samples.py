"""The sample ring and the window rules that decide which samples count for a response."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.observers.telemetry.samples import (
    SampleRing,
    capacity_for,
    counter_increase,
    last_at_or_before,
    max_of,
    min_of,
    window_bounds,
)

TIMES = [10.0, 11.0, 12.0, 13.0]


def test_samples_inside_the_window_count_with_both_ends_included() -> None:
    assert window_bounds(TIMES, 11.0, 12.0, max_age=5) == (1, 3)


def test_window_without_a_sample_inside_uses_the_newest_sample_before_the_start() -> None:
    assert window_bounds(TIMES, 12.2, 12.7, max_age=2.25) == (2, 3)


def test_sample_before_the_start_older_than_max_age_does_not_count() -> None:
    lo, hi = window_bounds(TIMES, 20.0, 20.5, max_age=2.25)
    assert lo == hi


def test_window_before_any_sample_has_no_samples() -> None:
    lo, hi = window_bounds(TIMES, 1.0, 2.0, max_age=100)
    assert lo == hi


def test_samples_after_the_end_never_count() -> None:
    lo, hi = window_bounds(TIMES, 9.0, 10.5, max_age=1)
    assert (lo, hi) == (0, 1)


def test_window_with_end_before_start_is_the_start_instant() -> None:
    assert window_bounds(TIMES, 12.0, 11.0, max_age=1) == (2, 3)


@given(st.lists(st.floats(0, 100, allow_nan=False), max_size=30).map(sorted),
       st.floats(0, 100, allow_nan=False), st.floats(0, 20, allow_nan=False), st.floats(0, 10, allow_nan=False))
def test_window_bounds_match_the_documented_rule(times: list[float], t0: float, length: float,
                                                  max_age: float) -> None:
    t1 = t0 + length
    lo, hi = window_bounds(times, t0, t1, max_age)
    inside = [i for i, t in enumerate(times) if t0 <= t <= t1]
    if inside:
        assert list(range(lo, hi)) == inside
        return
    before = [i for i, t in enumerate(times) if t < t0]
    newest = before[-1] if before else None
    expected = [newest] if newest is not None and t0 - times[newest] <= max_age else []
    assert list(range(lo, hi)) == expected


def test_last_at_or_before_finds_the_newest_sample_not_after_t() -> None:
    assert last_at_or_before(TIMES, 12.0) == 2
    assert last_at_or_before(TIMES, 12.5) == 2
    assert last_at_or_before(TIMES, 9.0) is None


def test_max_and_min_skip_unknown_values() -> None:
    assert max_of([None, 3.0, 1.0]) == 3.0
    assert min_of([None, 3.0, 1.0]) == 1.0
    assert max_of([None]) is None
    assert min_of([]) is None


def test_counter_increase_between_readings() -> None:
    assert counter_increase([5.0, 5.0, 7.0, 9.0]) == 4.0


def test_counter_drop_is_a_reset_and_counts_what_came_after_it() -> None:
    assert counter_increase([5.0, 8.0, 2.0, 3.0]) == 3.0 + 2.0 + 1.0


def test_counter_increase_needs_two_known_readings() -> None:
    assert counter_increase([4.0]) is None
    assert counter_increase([None, 4.0, None]) is None
    assert counter_increase([4.0, None, 6.0]) == 2.0


@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=2, max_size=20))
def test_counter_increase_is_never_negative(values: list[float]) -> None:
    increase = counter_increase(values)
    assert increase is not None and increase >= 0


def test_ring_keeps_only_the_newest_capacity_samples() -> None:
    ring: SampleRing[int] = SampleRing(3)
    for i in range(10):
        ring.append(float(i), i)
    assert len(ring) == 3
    assert ring.values(float) == [7.0, 8.0, 9.0]
    assert ring.window(0.0, 100.0, max_age=1) == [(7.0, 7), (8.0, 8), (9.0, 9)]
    assert ring.index_at_or_before(6.5) is None


def test_ring_memory_stays_within_twice_the_capacity() -> None:
    ring: SampleRing[int] = SampleRing(100)
    for i in range(10_000):
        ring.append(float(i), i)
        assert len(ring._times) < 200
    assert len(ring) == 100


def test_ring_raises_a_stamp_that_went_back_to_the_newest_one() -> None:
    ring: SampleRing[str] = SampleRing(10)
    ring.append(100.0, "a")
    ring.append(99.0, "b")  # the wall clock stepped back
    assert ring.window(100.0, 100.0, max_age=0) == [(100.0, "a"), (100.0, "b")]


def test_ring_span_and_latest() -> None:
    ring: SampleRing[str] = SampleRing(10)
    assert ring.latest() is None
    for i, name in enumerate("abcd"):
        ring.append(float(i), name)
    assert ring.span(1, 2) == [(1.0, "b"), (2.0, "c")]
    assert ring.latest() == (3.0, "d")
    assert ring.stamp(2) == 2.0


def test_capacity_holds_an_hour_within_bounds() -> None:
    assert capacity_for(1.0) == 3601
    assert capacity_for(0.01) == 36_000
    assert capacity_for(600) == 64
    assert capacity_for(0) == 64
