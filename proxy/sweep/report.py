"""The sweep's HTML report: one self-contained page (plotly.js embedded) with charts, table and verdict."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go  # type: ignore[import-untyped]
from plotly.offline import get_plotlyjs  # type: ignore[import-untyped]

from proxy.sweep.sample import Sample
from proxy.sweep.stats import LevelSummary, output_tokens, stop_label
from proxy.sweep.table import COLUMNS, ESTIMATE_NOTE, row
from proxy.sweep.verdict import Verdict

# Stop reasons in a fixed order and colour, so two reports read the same way.
STOP_COLOURS: dict[str, str] = {
    "eos": "#2ca02c", "stop_sequence": "#98df8a", "tool_calls": "#17becf",
    "length:requested_budget": "#bcbd22", "length:server_limit": "#d62728", "length": "#ff9896",
    "deadline": "#9467bd", "idle_timeout": "#c5b0d5", "rejected": "#ff7f0e",
    "client_disconnect": "#8c564b", "upstream_disconnect": "#e377c2", "upstream_error": "#7f7f7f",
    "content_filter": "#c49c94", "unknown": "#c7c7c7",
}
CHART_TITLES = ("Output tokens per response by concurrency", "Stop reasons by concurrency",
                "Time to first token by concurrency",
                "Inter-token latency (mean per response) by concurrency",
                "Duration vs output tokens (a wall-clock cap shows as a vertical wall)")
PLOT_CONFIG = {"displaylogo": False, "responsive": True}


def _layout(title: str, x_title: str, y_title: str, **extra: Any) -> dict[str, Any]:
    return {"title": {"text": title}, "xaxis": {"title": {"text": x_title}},
            "yaxis": {"title": {"text": y_title}}, "height": 420, "margin": {"t": 60, "b": 50},
            "template": "plotly_white", **extra}


def _box_figure(groups: Mapping[int, Sequence[Sample]], values: Any, title: str, y_title: str) -> Any:
    figure = go.Figure()
    for level, samples in groups.items():
        ys = [v for v in (values(s) for s in samples) if v is not None]
        figure.add_trace(go.Box(y=ys, name=str(level), boxpoints="all", jitter=0.4, pointpos=0,
                                marker={"size": 5}, showlegend=False))
    figure.update_layout(**_layout(title, "concurrency", y_title))
    return figure


def charts(groups: Mapping[int, Sequence[Sample]]) -> list[Any]:
    """The report's figures, in CHART_TITLES order."""
    levels = [str(level) for level in groups]
    tokens = _box_figure(groups, lambda s: output_tokens(s.record), CHART_TITLES[0], "output tokens")
    stops = go.Figure()
    labels = sorted({stop_label(s.record) for samples in groups.values() for s in samples},
                    key=lambda k: list(STOP_COLOURS).index(k) if k in STOP_COLOURS else len(STOP_COLOURS))
    for label in labels:
        counts = [sum(1 for s in samples if stop_label(s.record) == label) for samples in groups.values()]
        stops.add_trace(go.Bar(x=levels, y=counts, name=label, marker={"color": STOP_COLOURS.get(label)}))
    stops.update_layout(**_layout(CHART_TITLES[1], "concurrency", "responses", barmode="stack",
                                  showlegend=True))
    stops.update_xaxes(type="category")
    ttft = _box_figure(groups, lambda s: s.record.ttft_s, CHART_TITLES[2], "seconds")
    itl = _box_figure(groups, lambda s: s.record.itl_mean_s, CHART_TITLES[3], "seconds")
    scatter = go.Figure()
    for level, samples in groups.items():
        scatter.add_trace(go.Scatter(
            x=[s.record.duration_s for s in samples], y=[output_tokens(s.record) for s in samples],
            mode="markers", name=f"c={level}", marker={"size": 7, "opacity": 0.75},
            text=[stop_label(s.record) for s in samples], hovertemplate="%{x:.2f}s, %{y} tokens, %{text}"))
    scatter.update_layout(**_layout(CHART_TITLES[4], "duration (s)", "output tokens"))
    return [tokens, stops, ttft, itl, scatter]


def _table_html(summaries: Sequence[LevelSummary]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row(s)) + "</tr>"
                   for s in summaries)
    note = f"<p>{html.escape(ESTIMATE_NOTE)}</p>" if any(s.tokens_counted for s in summaries) else ""
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{note}"


def _verdict_html(verdict: Verdict) -> str:
    inferred = " <em>(inferred from the numbers)</em>" if verdict.inferred else ""
    evidence = "".join(f"<li>{html.escape(line)}</li>" for line in verdict.evidence)
    return (f'<section class="verdict verdict-{html.escape(verdict.kind)}"><h2>Verdict: '
            f"{html.escape(verdict.kind.replace('_', ' '))}{inferred}</h2>"
            f"<p class=\"headline\">{html.escape(verdict.headline)}</p><ul>{evidence}</ul>"
            f"<p class=\"recommendation\"><strong>Next:</strong> {html.escape(verdict.recommendation)}</p>"
            "</section>")


def render(summaries: Sequence[LevelSummary], groups: Mapping[int, Sequence[Sample]], verdict: Verdict,
           plan: Mapping[str, Any]) -> str:
    """The whole page as one string; it loads nothing from the network."""
    figures = "".join(
        '<div class="chart">' + figure.to_html(full_html=False, include_plotlyjs=False,
                                                div_id=f"chart-{i}", config=PLOT_CONFIG) + "</div>"
        for i, figure in enumerate(charts(groups)))
    settings = ", ".join(f"{k}={v}" for k, v in plan.items() if k not in ("prompt", "admin_token"))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>llm-diag-proxy concurrency sweep</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; font-size: 13px; margin: 1em 0; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
td:last-child, th:last-child {{ text-align: left; }}
.verdict {{ border-left: 6px solid #d62728; background: #fafafa; padding: 0.5em 1em; }}
.verdict-no_load_effect {{ border-left-color: #2ca02c; }}
.chart {{ max-width: 1100px; }}
.settings {{ color: #666; font-size: 13px; }}
</style>
<script type="text/javascript">{get_plotlyjs()}</script>
</head><body>
<h1>Concurrency sweep</h1>
<p class="settings">{html.escape(settings)}</p>
{_verdict_html(verdict)}
<h2>Per level</h2>
{_table_html(summaries)}
<h2>Charts</h2>
{figures}
</body></html>
"""
