"""The report page as text: self-contained, one plotly.js, the verdict and the table in it."""

from __future__ import annotations

import re

from proxy.sweep.report import CHART_TITLES
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
