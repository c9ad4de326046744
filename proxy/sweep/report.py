"""The sweep's HTML report: one self-contained page (plotly.js embedded) with charts, table and verdict."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go  # type: ignore[import-untyped]
from plotly.offline import get_plotlyjs  # type: ignore[import-untyped]

from proxy.sweep.sample import Sample
from proxy.sweep.stats import LevelSummary, output_tokens, stop_label
from proxy.sweep.table import COLUMN_HELP, COLUMNS, ESTIMATE_NOTE, row
from proxy.sweep.verdict import Verdict

# Stop reasons in a fixed order and colour, so two reports read the same way.
STOP_COLOURS: dict[str, str] = {
    "eos": "#2ca02c", "stop_sequence": "#98df8a", "tool_calls": "#17becf",
    "length:requested_budget": "#bcbd22", "length:server_limit": "#d62728", "length": "#ff9896",
    "deadline": "#9467bd", "idle_timeout": "#c5b0d5", "rejected": "#ff7f0e",
    "client_disconnect": "#8c564b", "upstream_disconnect": "#e377c2", "upstream_error": "#7f7f7f",
    "content_filter": "#c49c94", "unknown": "#c7c7c7",
}
CHART_TITLES = ("Output tokens per response by concurrency (dashed: the requested budget)",
                "Completion rate by concurrency", "Stop reasons by concurrency",
                "Throughput by concurrency", "End-to-end latency percentiles by concurrency",
                "Time to first token by concurrency",
                "Inter-token latency (mean per response) by concurrency",
                "Duration vs output tokens (a wall-clock cap shows as a vertical wall)")
MS = 1000.0
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


def _ms(value: float | None) -> float | None:
    return None if value is None else value * MS


def _line_figure(summaries: Sequence[LevelSummary], title: str, y_title: str,
                 lines: Mapping[str, Any], **layout: Any) -> Any:
    """One line per figure of the summaries (None leaves a gap), concurrency as categories."""
    figure = go.Figure()
    levels = [str(s.level) for s in summaries]
    for name, value in lines.items():
        figure.add_trace(go.Scatter(x=levels, y=[value(s) for s in summaries], mode="lines+markers", name=name))
    figure.update_layout(**_layout(title, "concurrency", y_title, showlegend=True, **layout))
    figure.update_xaxes(type="category")
    return figure


def charts(groups: Mapping[int, Sequence[Sample]], summaries: Sequence[LevelSummary]) -> list[Any]:
    """The report's figures, in CHART_TITLES order."""
    levels = [str(level) for level in groups]
    tokens = _box_figure(groups, lambda s: output_tokens(s.record), CHART_TITLES[0], "output tokens")
    budgets = sorted({s.requested_max_tokens for s in summaries if s.requested_max_tokens is not None})
    for budget in budgets:
        tokens.add_hline(y=budget, line={"dash": "dash", "color": "#555"},
                         annotation={"text": f"requested budget {budget}"}, annotation_position="top left")
    completion = _line_figure(summaries, CHART_TITLES[1], "answers complete (%)",
                              {"complete": lambda s: s.completion_rate * 100},
                              yaxis={"title": {"text": "answers complete (%)"}, "range": [0, 105]})
    throughput = _line_figure(summaries, CHART_TITLES[3], "output tokens/s",
                              {"output tokens/s": lambda s: s.output_tokens_per_s})
    throughput.add_trace(go.Scatter(x=[str(s.level) for s in summaries], y=[s.requests_per_s for s in summaries],
                                    mode="lines+markers", name="requests/s", yaxis="y2"))
    throughput.update_layout(yaxis2={"title": {"text": "requests/s"}, "overlaying": "y", "side": "right",
                                     "rangemode": "tozero"}, yaxis={"rangemode": "tozero",
                                                                    "title": {"text": "output tokens/s"}})
    latency = _line_figure(summaries, CHART_TITLES[4], "ms", {
        "p50": lambda s: _ms(s.latency_p50_s), "p95": lambda s: _ms(s.latency_p95_s),
        "p99": lambda s: _ms(s.latency_p99_s)})
    stops = go.Figure()
    labels = sorted({stop_label(s.record) for samples in groups.values() for s in samples},
                    key=lambda k: list(STOP_COLOURS).index(k) if k in STOP_COLOURS else len(STOP_COLOURS))
    for label in labels:
        counts = [sum(1 for s in samples if stop_label(s.record) == label) for samples in groups.values()]
        stops.add_trace(go.Bar(x=levels, y=counts, name=label, marker={"color": STOP_COLOURS.get(label)}))
    stops.update_layout(**_layout(CHART_TITLES[2], "concurrency", "responses", barmode="stack",
                                  showlegend=True))
    stops.update_xaxes(type="category")
    ttft = _box_figure(groups, lambda s: _ms(s.record.ttft_s), CHART_TITLES[5], "ms")
    itl = _box_figure(groups, lambda s: _ms(s.record.itl_mean_s), CHART_TITLES[6], "ms")
    scatter = go.Figure()
    for level, samples in groups.items():
        scatter.add_trace(go.Scatter(
            x=[s.record.duration_s * MS for s in samples], y=[output_tokens(s.record) for s in samples],
            mode="markers", name=f"c={level}", marker={"size": 7, "opacity": 0.75},
            text=[stop_label(s.record) for s in samples], hovertemplate="%{x:.0f} ms, %{y} tokens, %{text}"))
    scatter.update_layout(**_layout(CHART_TITLES[7], "duration (ms)", "output tokens"))
    return [tokens, completion, stops, throughput, latency, ttft, itl, scatter]


LIVE_LEVEL_HELP = ("concurrency: the bucket of the most requests in flight while each answer ran (live traffic, "
                   "grouped after the fact: observational, not a controlled level)")


def _table_html(summaries: Sequence[LevelSummary], live: bool = False) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row(s)) + "</tr>"
                   for s in summaries)
    note = f"<p>{html.escape(ESTIMATE_NOTE)}</p>" if any(s.tokens_counted for s in summaries) else ""
    helps = {**COLUMN_HELP, **({"conc": LIVE_LEVEL_HELP} if live else {})}
    legend = "".join(f"<dt>{html.escape(column)}</dt><dd>{html.escape(helps[column])}</dd>"
                     for column in COLUMNS)
    return (f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{note}"
            f'<dl class="legend">{legend}</dl>')


RUN_FIELDS = (("date", "Run"), ("tool", "Tool"), ("version", "Version"), ("target", "Target"),
              ("model", "Model"), ("dialect", "Dialect"), ("server_type", "Server"))


def _metadata_html(plan: Mapping[str, Any]) -> str:
    """Which run this is: date, tool version, target, model, server type (what `run` holds)."""
    run = plan.get("run") or {}
    known = {**{k: plan.get(k) for k in ("target", "model", "dialect")}, **run}
    cells = "".join(f"<dt>{label}</dt><dd>{html.escape(str(known[key]))}</dd>"
                    for key, label in RUN_FIELDS if known.get(key) is not None)
    return f'<dl class="run">{cells}</dl>'



def _verdict_html(verdict: Verdict) -> str:
    inferred = " <em>(inferred from the numbers)</em>" if verdict.inferred else ""
    evidence = "".join(f"<li>{html.escape(line)}</li>" for line in verdict.evidence)
    return (f'<section class="verdict verdict-{html.escape(verdict.kind)}"><h2>Verdict: '
            f"{html.escape(verdict.kind.replace('_', ' '))}{inferred}</h2>"
            f"<p class=\"headline\">{html.escape(verdict.headline)}</p><ul>{evidence}</ul>"
            f"<p class=\"recommendation\"><strong>Next:</strong> {html.escape(verdict.recommendation)}</p>"
            "</section>")


def _rates_html(plan: Mapping[str, Any]) -> str:
    """An open-loop sweep's table by arrival rate, with goodput (empty for a closed-loop sweep)."""
    rates = plan.get("rates_summary")
    if not rates:
        return ""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * MS:.0f}"

    head = ("<tr><th>rate/s</th><th>sent</th><th>complete</th><th>goodput/s</th><th>good</th><th>TTFT p50 ms</th>"
            "<th>TTFT p95 ms</th><th>e2e p50 ms</th><th>e2e p95 ms</th><th>concurrency met (median/max)</th></tr>")
    rows = "".join(
        f"<tr><td>{r['rate']:g}</td><td>{r['sent']}</td><td>{r['completion_rate']:.0%}</td>"
        f"<td>{r['goodput_per_s']:.2f}</td><td>{r['good'] / r['sent'] if r['sent'] else 0:.0%}</td>"
        f"<td>{ms(r['ttft_p50_s'])}</td><td>{ms(r['ttft_p95_s'])}</td><td>{ms(r['e2e_p50_s'])}</td>"
        f"<td>{ms(r['e2e_p95_s'])}</td><td>{r['concurrency_median'] or 0:g}/{r['concurrency_max']}</td></tr>"
        for r in rates)
    slo = html.escape(str(plan.get("slo", "complete only")))
    return (f'<h2>Open loop: by arrival rate ({html.escape(str(plan.get("arrivals")))})</h2>'
            f'<p class="settings">goodput: answers that ended on their own within {slo}</p>'
            f'<table class="rates">{head}{rows}</table>')


def render(summaries: Sequence[LevelSummary], groups: Mapping[int, Sequence[Sample]], verdict: Verdict,
           plan: Mapping[str, Any]) -> str:
    """The whole page as one string; it loads nothing from the network."""
    figures = "".join(
        '<div class="chart">' + figure.to_html(full_html=False, include_plotlyjs=False,
                                                div_id=f"chart-{i}", config=PLOT_CONFIG) + "</div>"
        for i, figure in enumerate(charts(groups, summaries)))
    settings = ", ".join(f"{k}={v}" for k, v in plan.items() if k not in ("prompt", "admin_token", "run"))
    live = str(plan.get("kind", "")).startswith("diagnose")
    title = "Live traffic by concurrency (observational)" if live else "Concurrency sweep"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>llm-diag-proxy: {title.lower()}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; font-size: 13px; margin: 1em 0; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
td:last-child, th:last-child {{ text-align: left; }}
.verdict {{ border-left: 6px solid #d62728; background: #fafafa; padding: 0.5em 1em; }}
.verdict-no_load_effect {{ border-left-color: #2ca02c; }}
.chart {{ max-width: 1100px; }}
.settings {{ color: #666; font-size: 13px; }}
dl.run {{ display: grid; grid-template-columns: max-content auto; gap: 2px 1em; font-size: 14px; }}
dl.run dt {{ font-weight: 600; }} dl.run dd {{ margin: 0; }}
dl.legend {{ font-size: 13px; color: #444; columns: 2; }}
dl.legend dt {{ font-weight: 600; }} dl.legend dd {{ margin: 0 0 0.4em 1em; }}
</style>
<script type="text/javascript">{get_plotlyjs()}</script>
</head><body>
<h1>{title}</h1>
{_metadata_html(plan)}
<p class="settings">{html.escape(settings)}</p>
{_verdict_html(verdict)}
{_rates_html(plan)}
<h2>{"By the concurrency each request met" if plan.get("rates_summary") or live else "Per level"}</h2>
{_table_html(summaries, live)}
<h2>Charts</h2>
{figures}
</body></html>
"""
