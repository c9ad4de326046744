"""The printed per-level table: one row per level, figures people read, estimates marked."""

from __future__ import annotations

from proxy.sweep.stats import summarize, summarize_level
from proxy.sweep.table import COLUMN_HELP, COLUMNS, ESTIMATE_NOTE, gib, rate, render, row, seconds, stop_mix
from tests.support.sweep_samples import level, sample


def test_seconds_are_milliseconds_below_one_second() -> None:
    assert (seconds(None), seconds(0.0123), seconds(2.414)) == ("-", "12ms", "2.41s")


def test_gib_and_unknown() -> None:
    assert (gib(None), gib(3 * 2**30)) == ("-", "3.00 GiB")


def test_stop_mix_lists_the_most_frequent_first() -> None:
    assert stop_mix({"eos": 2, "length:server_limit": 5}) == "length:server_limit 5, eos 2"


def test_a_row_has_every_column_in_order() -> None:
    samples = [sample(4, 0, tokens=100, kv_cache_usage_max=0.912, vram_free_min_bytes=2**30,
                      preemptions_during=1.0, deadline_hit="total"),
               sample(4, 1, tokens=40, stop="length", length_cause="server_limit", client_disconnected=True)]
    cells = row(summarize_level(4, samples))
    assert len(cells) == len(COLUMNS)
    assert cells == ("4", "2", "70 [55-85]", "-", "50% [9-91]", "140", "2", "200ms/200ms", "40ms/40ms",
                     "1.00s/1.00s/1.00s", "1", "1", "1/1", "1.00 GiB", "91%", "eos 1, length:server_limit 1")


def test_every_column_has_a_legend() -> None:
    assert list(COLUMN_HELP) == list(COLUMNS)
    assert all(COLUMN_HELP.values())


def test_rates_keep_three_figures_below_a_hundred() -> None:
    assert (rate(None), rate(1234.4), rate(12.345), rate(0.4234)) == ("-", "1234", "12.3", "0.423")


def test_counted_token_figures_are_marked_as_estimates() -> None:
    summaries = summarize(level(1, 2, tokens_source="counted") + level(2, 2, tokens_source="usage"))
    text = render(summaries)
    assert "~100 [100-100]" in text and " 100 [100-100]" in text
    assert text.endswith(ESTIMATE_NOTE)


def test_the_table_has_a_header_a_rule_and_one_line_per_level() -> None:
    text = render(summarize(level(1, 2) + level(8, 3)))
    lines = text.splitlines()
    assert lines[0].startswith("conc") and set(lines[1]) == {"-"} and len(lines) == 4
    assert lines[2].split()[:2] == ["1", "2"] and lines[3].split()[:2] == ["8", "3"]
    assert ESTIMATE_NOTE not in text
