"""The report page as text: self-contained, one plotly.js, the verdict and the table in it."""

from __future__ import annotations

import html
import re

from proxy.sweep.report import CHART_TITLES
from proxy.sweep.table import COLUMN_HELP
from tests.support.report_fixture import capped_report


def test_the_page_loads_nothing_from_the_network() -> None:
    page = capped_report()
    assert not re.search(r"<(script|link|img|iframe)\b[^>]*\b(src|href)=", page)
    assert page.count("<script") >= 1 + len(CHART_TITLES)


def test_plotly_js_is_embedded_once() -> None:
    page = capped_report()
    assert page.count("Plotly.newPlot") == len(CHART_TITLES)
    assert page.count("plotly.js v") <= 2  # the bundle's banner, once (may appear in its license text)
    assert len(page) > 3_000_000


def test_the_page_holds_the_verdict_and_one_table_row_per_level() -> None:
    page = capped_report()
    assert "Verdict: hidden cap <em>(inferred from the numbers)</em>" in page
    assert page.count("<tr>") == 1 + 4
    for title in CHART_TITLES:
        assert title in page


def test_the_page_says_which_run_it_is() -> None:
    page = capped_report()
    for shown in ("<dt>Run</dt><dd>2026-12-03T10:00:00+00:00</dd>", "<dt>Version</dt><dd>0.1.0</dd>",
                  "<dt>Target</dt><dd>http://127.0.0.1:8080</dd>", "<dt>Model</dt><dd>qwen3:8b</dd>",
                  "<dt>Server</dt><dd>vLLM</dd>"):
        assert shown in page
    assert "run={" not in page  # the metadata is not repeated in the settings line


def test_every_table_column_has_a_legend_entry_on_the_page() -> None:
    page = capped_report()
    for column, meaning in COLUMN_HELP.items():
        assert f"<dt>{html.escape(column)}</dt><dd>{html.escape(meaning)}</dd>" in page
    assert "preempted at least once" in page  # what `preempt n/m` means


def test_the_budget_line_and_the_new_charts_are_drawn() -> None:
    page = capped_report()
    assert "requested budget 200" in page
    for title in ("Completion rate by concurrency", "Throughput by concurrency",
                  "End-to-end latency percentiles by concurrency"):
        assert title in CHART_TITLES and title in page
    assert '"text":"ms"' in page.replace(" ", "")  # TTFT and ITL axes in ms, like the table
