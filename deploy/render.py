"""Renders the deployment files that are derived from one source, so they cannot drift apart.

- grafana/dashboards/llm-diag-proxy.json: the dashboard, from the panel list below.
- deploy/k8s/prometheusrule.yaml: the Prometheus Operator's PrometheusRule, from the rule groups
  of deploy/prometheus/rules/*.yml (the files the compose stack's Prometheus loads).

`python deploy/render.py` writes both; `python deploy/render.py --check` exits 1 when a committed
file differs from what this script renders (tests/test_deploy_files.py runs the check).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
RULE_FILES = (ROOT / "deploy/prometheus/rules/recording.yml", ROOT / "deploy/prometheus/rules/alerts.yml")
PROMETHEUS_RULE_PATH = ROOT / "deploy/k8s/prometheusrule.yaml"
DASHBOARD_PATH = ROOT / "grafana/dashboards/llm-diag-proxy.json"
DASHBOARD_UID = "llm-diag-proxy"
DASHBOARD_TITLE = "LLM diag proxy: are answers cut, and why"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# Label selectors shared by the panels: the dashboard's instance and model variables.
INST = 'instance=~"$instance"'
IM = 'instance=~"$instance",model=~"$model"'
ANSWERS = f'llm_proxy_requests_total{{{IM},stop_reason!="not_inference"}}'
CUT = f'llm_proxy_requests_total{{{IM},stop_reason!~"eos|stop_sequence|tool_calls|not_inference"}}'
W = "[$__rate_interval]"


def target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref, "range": True}


def panel(kind: str, title: str, description: str, grid: tuple[int, int, int, int],
          targets: list[tuple[str, str]], unit: str = "short", **options: Any) -> dict[str, Any]:
    """One panel; `grid` is (x, y, w, h) on Grafana's 24-column grid, `targets` (expr, legend) pairs."""
    x, y, w, h = grid
    custom: dict[str, Any] = {}
    if kind == "timeseries":
        custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                  "spanNulls": False, "stacking": {"mode": options.pop("stacking", "none"), "group": "A"}}
    result: dict[str, Any] = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "targets": [target(expr, legend, chr(ord("A") + n)) for n, (expr, legend) in enumerate(targets)],
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": options.pop("overrides", [])},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}} if kind == "timeseries" else
                   {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "value", "graphMode": "area", "textMode": "auto"},
    }
    result.update(options)
    return result


def right_axis(name_regex: str, unit: str) -> dict[str, Any]:
    """A field override that moves the series whose display name matches to the right axis."""
    return {"matcher": {"id": "byRegexp", "options": name_regex},
            "properties": [{"id": "custom.axisPlacement", "value": "right"}, {"id": "unit", "value": unit}]}


def row(title: str, y: int) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
            "panels": []}


def quantile(q: float, metric: str, selector: str, by: str = "concurrency") -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{{{selector}}}{W})))"


def panels() -> list[dict[str, Any]]:
    """The dashboard, top to bottom: the verdict first, then why, then speed, memory and failures."""
    return [
        panel("stat", "Answers cut (5m)", "Share of answers that did not end on their own (eos, stop "
              "sequence, tool call) over the last 5 minutes.", (0, 0, 6, 4),
              [(f"sum(rate(llm_proxy_truncated_total{{{IM}}}[5m])) / sum(rate({ANSWERS}[5m]))", "cut")],
              unit="percentunit"),
        panel("stat", "Answers per second", "Inference responses per second (scrapes and model listings "
              "left out).", (6, 0, 6, 4), [(f"sum(rate({ANSWERS}{W}))", "answers/s")], unit="reqps"),
        panel("stat", "In flight", "Inference requests in flight through the proxy now.", (12, 0, 6, 4),
              [(f"sum(llm_proxy_in_flight{{{INST}}})", "in flight")]),
        panel("stat", "Proxies up", "Proxy targets Prometheus scrapes successfully, of all it knows.",
              (18, 0, 6, 4), [(f'sum(up{{job="llm-diag-proxy",{INST}}})', "up"),
                              (f'count(up{{job="llm-diag-proxy",{INST}}})', "known")]),
        row("Are answers cut, and why", 4),
        panel("timeseries", "Stop-reason mix", "How responses ended, as a share of all answers. Anything "
              "but eos, stop_sequence and tool_calls is a cut answer; records: /api/requests?stop_reason=...",
              (0, 5, 12, 8), [(f"sum by (stop_reason) (rate({ANSWERS}{W}))", "{{stop_reason}}")],
              unit="reqps", stacking="percent"),
        panel("timeseries", "Truncation ratio by cause", "Cut answers by cause, as a share of all answers. "
              "server_limit: a length stop below the max_tokens the client asked for (the server's "
              "context limit).", (12, 5, 12, 8),
              [(f"sum by (cause) (rate(llm_proxy_truncated_total{{{IM}}}{W})) "
                f"/ on () group_left () sum(rate({ANSWERS}{W}))", "{{cause}}")],
              unit="percentunit"),
        panel("timeseries", "Truncation ratio by concurrency", "Share of cut answers per concurrency bucket "
              "(the peak number of requests in flight during each response). Rising with the bucket: load "
              "cuts answers.", (0, 13, 12, 8),
              [(f"sum by (concurrency) (rate({CUT}{W})) / sum by (concurrency) (rate({ANSWERS}{W}))",
                "c={{concurrency}}")], unit="percentunit"),
        panel("timeseries", "Output tokens by concurrency", "Median output tokens per answer by concurrency "
              "bucket, against the median budget clients asked for. Medians that fall as concurrency rises, "
              "with the budget unchanged, mean the server shortens answers under load.", (12, 13, 12, 8),
              [(quantile(0.5, "llm_proxy_output_tokens", f'{IM},stop_reason!="not_inference"'),
                "p50 c={{concurrency}}"),
               (f"histogram_quantile(0.5, sum by (le) (rate(llm_proxy_requested_max_tokens_bucket{{{IM}}}{W})))",
                "requested max_tokens (p50)")]),
        row("Speed under load", 21),
        panel("timeseries", "Time to first token by concurrency", "p50 and p95 of the time from request to "
              "the first content chunk, by concurrency bucket: queueing shows here first.", (0, 22, 12, 8),
              [(quantile(0.5, "llm_proxy_time_to_first_token_seconds", IM), "p50 c={{concurrency}}"),
               (quantile(0.95, "llm_proxy_time_to_first_token_seconds", IM), "p95 c={{concurrency}}")],
              unit="s"),
        panel("timeseries", "Inter-token latency by concurrency", "p50 and p95 of each response's mean gap "
              "between content chunks, by concurrency bucket. Jumps with preemptions.", (12, 22, 12, 8),
              [(quantile(0.5, "llm_proxy_inter_token_latency_seconds", IM), "p50 c={{concurrency}}"),
               (quantile(0.95, "llm_proxy_inter_token_latency_seconds", IM), "p95 c={{concurrency}}")],
              unit="s"),
        row("Memory and the server's own state", 30),
        panel("timeseries", "In flight vs GPU memory", "Requests in flight (left axis) and GPU memory used and "
              "free per GPU (right axis) on one time axis: where free memory runs out, at which concurrency. "
              "Ollama: VRAM per loaded model too.", (0, 31, 24, 9),
              [(f"sum(llm_proxy_in_flight{{{INST}}})", "in flight"),
               (f"llm_proxy_gpu_memory_used_bytes{{{INST}}}", "used {{instance}} gpu{{gpu}}"),
               (f"llm_proxy_gpu_memory_free_bytes{{{INST}}}", "free {{instance}} gpu{{gpu}}"),
               (f"llm_proxy_upstream_model_vram_bytes{{{INST}}}", "model VRAM {{model}}")],
              overrides=[right_axis("^(used|free|model VRAM) .*", "bytes")]),
        panel("timeseries", "Upstream KV cache and preemptions", "The upstream's KV-cache usage (vLLM, left "
              "axis) and preemptions in each interval (right axis): a full cache preempts and recomputes.",
              (0, 40, 8, 8),
              [(f"llm_proxy_upstream_kv_cache_usage_ratio{{{INST}}}", "KV usage {{instance}}"),
               (f"increase(llm_proxy_upstream_preemptions{{{INST}}}{W})", "preemptions {{instance}}")],
              unit="percentunit", overrides=[right_axis("^preemptions .*", "short")]),
        panel("timeseries", "Upstream queue: running and waiting", "What the upstream says it runs and queues, "
              "against what the proxy has in flight: waiting > 0 means requests queue in the server.",
              (8, 40, 8, 8),
              [(f"llm_proxy_upstream_requests_running{{{INST}}}", "running {{instance}}"),
               (f"llm_proxy_upstream_requests_waiting{{{INST}}}", "waiting {{instance}}"),
               (f"sum(llm_proxy_in_flight{{{INST}}})", "proxy in flight")]),
        panel("timeseries", "GPU utilization", "NVML's utilization per GPU (0-1), and whether the proxy's GPU "
              "and upstream telemetry work (1 = yes).", (16, 40, 8, 8),
              [(f"llm_proxy_gpu_utilization_ratio{{{INST}}}", "util {{instance}} gpu{{gpu}}"),
               (f"llm_proxy_gpu_telemetry_up{{{INST}}}", "GPU telemetry up {{instance}}"),
               (f"llm_proxy_upstream_telemetry_up{{{INST}}}", "upstream telemetry up {{source}}")],
              unit="percentunit"),
        row("Failures", 48),
        panel("timeseries", "Client disconnects and deadline hits", "Clients that went away (before the first "
              "token: usually their own timeout while queued) and responses past the proxy's --deadline or "
              "--idle-timeout, per interval. Records: /api/requests?stop_reason=client_disconnect, "
              "?stop_reason=deadline, ?stop_reason=idle_timeout.", (0, 49, 12, 8),
              [(f"sum by (phase) (increase(llm_proxy_client_disconnects_total{{{INST}}}{W}))", "disconnect {{phase}}"),
               (f"sum by (kind, mode) (increase(llm_proxy_deadline_hits_total{{{INST}}}{W}))",
                "deadline {{kind}} ({{mode}})")]),
        panel("timeseries", "Upstream errors and rejections", "Upstream failures per interval by kind (oom: "
              "out of memory; context_exhausted: the KV cache / context ran out, a pool the requests share; "
              "exceeds_context: a request larger than the context one request gets; http_status: an HTTP "
              "error other than 429/503), requests the server refused "
              "(429/503: load shedding) and responses the parser could not fully read. Records: "
              "/api/requests?stop_reason=upstream_error, ?stop_reason=rejected.",
              (12, 49, 12, 8),
              [(f"sum by (kind) (increase(llm_proxy_upstream_errors_total{{{INST}}}{W}))", "{{kind}}"),
               (f'sum(increase(llm_proxy_requests_total{{{IM},stop_reason="rejected"}}{W}))', "rejected (429/503)"),
               (f"sum by (dialect) (increase(llm_proxy_parse_errors_total{{{INST}}}{W}))", "parse error {{dialect}}")]),
        panel("timeseries", "Length stops spent on reasoning", "Length stops per interval whose budget went "
              "mostly (50% or more) to the model's thinking (reasoning models: delta.reasoning, thinking "
              "blocks, reasoning_tokens), next to all length stops: the visible answer got what the "
              "thinking left. Records: /api/requests?stop_reason=length (reasoning_share).", (0, 57, 24, 7),
              [(f"sum by (model) (increase(llm_proxy_reasoning_exhausted_total{{{IM}}}{W}))",
                "mostly reasoning {{model}}"),
               (f'sum by (model) (increase(llm_proxy_requests_total{{{IM},stop_reason="length"}}{W}))',
                "all length stops {{model}}")]),
        {"type": "text", "title": "Where the records are", "gridPos": {"x": 0, "y": 64, "w": 24, "h": 4},
         "options": {"mode": "markdown", "content": (
             "Every response has a record on the proxy's admin port (default 127.0.0.1:9464): "
             "`/api/requests?stop_reason=length` lists the answers cut for length, with the requested "
             "budget, the output tokens, the concurrency and the GPU memory during the response. "
             "Figures here are sums over the selected instances; ratios are computed after summing.")}},
    ]


def variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "query": query, "definition": query,
            "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1}


def dashboard() -> dict[str, Any]:
    """The whole dashboard JSON (Grafana schema 39), with datasource, instance and model variables."""
    panel_list = panels()
    for n, item in enumerate(panel_list, start=1):
        item["id"] = n
    return {
        "uid": DASHBOARD_UID,
        "title": DASHBOARD_TITLE,
        "description": "llm-diag-proxy: why every response ended, under how much concurrency, how fast.",
        "tags": ["llm", "llm-diag-proxy"],
        "editable": False,
        "graphTooltip": 1,  # a shared crosshair: one time axis across panels
        "refresh": "10s",
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "",
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {"selected": True, "text": "Prometheus", "value": "prometheus"}, "hide": 0},
            variable("instance", "Instance", 'label_values(up{job="llm-diag-proxy"}, instance)'),
            variable("model", "Model", 'label_values(llm_proxy_requests_total{instance=~"$instance"}, model)'),
        ]},
        "annotations": {"list": []},
        "links": [],
        "panels": panel_list,
    }


def dashboard_expressions(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of the dashboard, template variables as written."""
    return [(item["title"], t["expr"]) for item in board["panels"] for t in item.get("targets", [])]


def rule_groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = []
    for path in RULE_FILES:
        groups.extend(yaml.safe_load(path.read_text())["groups"])
    return groups


class _BlockDumper(yaml.SafeDumper):
    """Writes multi-line strings (PromQL) as `|` blocks, as a person would."""


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_BlockDumper.add_representer(str, _represent_str)


def prometheus_rule() -> str:
    """The PrometheusRule manifest text: the same groups, wrapped for the Prometheus Operator."""
    manifest = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "llm-diag-proxy",
                     "labels": {"app.kubernetes.io/name": "llm-diag-proxy",
                                "app.kubernetes.io/component": "alerting"}},
        "spec": {"groups": rule_groups()},
    }
    header = ("# GENERATED by deploy/render.py from deploy/prometheus/rules/*.yml: edit those, then run\n"
              "# `python deploy/render.py`. A kube-prometheus-stack Prometheus picks this up only if its\n"
              "# ruleSelector matches these labels (often `release: <helm release>`: add it here via kustomize).\n")
    return header + yaml.dump(manifest, Dumper=_BlockDumper, sort_keys=False, width=120, allow_unicode=True)


def rendered() -> dict[Path, str]:
    return {DASHBOARD_PATH: json.dumps(dashboard(), indent=2) + "\n", PROMETHEUS_RULE_PATH: prometheus_rule()}


def main(argv: list[str]) -> int:
    check = "--check" in argv[1:]
    stale = []
    for path, text in rendered().items():
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
        else:
            path.write_text(text)
    for path in stale:
        print(f"{path.relative_to(ROOT)} is not what deploy/render.py renders: run python deploy/render.py",
              file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
