"""The report page in a real headless chromium: every chart rendered (plotly drew its SVG)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest

from proxy.sweep.report import CHART_TITLES
from tests.support.report_fixture import capped_report

CHROMIUM = next((path for name in ("chromium", "chromium-browser", "google-chrome")
                 if (path := shutil.which(name))), None)
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--virtual-time-budget=5000")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)"),
]


class ChartSvgCounter(HTMLParser):
    """Counts plotly's `main-svg` elements inside each `chart-N` graph div of a rendered DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.svgs: dict[str, int] = {}
        self._chart: str | None = None
        self._depth = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if self._chart is not None:
            if tag not in ("br", "img", "input", "meta", "link"):
                self._depth += 1
            if tag == "svg" and "main-svg" in (attributes.get("class") or "").split():
                self.svgs[self._chart] += 1
        elif tag == "div" and (attributes.get("id") or "").startswith("chart-"):
            self._chart = attributes["id"]
            self.svgs[self._chart] = 0
            self._depth = 1

    def handle_endtag(self, tag: str) -> None:
        if self._chart is not None and tag not in ("br", "img", "input", "meta", "link"):
            self._depth -= 1
            if self._depth == 0:
                self._chart = None


def chromium(*args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                              text=True, timeout=90, check=False)


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("report") / "report.html"
    path.write_text(capped_report(), encoding="utf-8")
    return path


def test_every_chart_is_rendered_by_plotly_in_a_real_browser(page: Path) -> None:
    result = chromium("--dump-dom", page.as_uri())
    assert result.returncode == 0, result.stderr[-2000:]
    counter = ChartSvgCounter()
    counter.feed(result.stdout)
    assert sorted(counter.svgs) == [f"chart-{i}" for i in range(len(CHART_TITLES))]
    assert all(count >= 1 for count in counter.svgs.values()), counter.svgs
    assert "js-plotly-plot" in result.stdout
    dom = result.stdout.replace("&gt;", ">")
    for title in CHART_TITLES:  # plotly writes each title into the SVG as text
        assert f">{title}</text>" in dom
    assert ">requested budget 200</text>" in dom  # the reference line's label on the output-token chart
    assert ">complete</text>" in dom and ">requests/s</text>" in dom and ">p99</text>" in dom  # legends


def test_the_rendered_page_screenshots(page: Path, tmp_path: Path) -> None:
    shot = tmp_path / "report.png"
    result = chromium("--window-size=1280,2800", f"--screenshot={shot}", page.as_uri())
    assert result.returncode == 0, result.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000
