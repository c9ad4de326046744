"""Renders the deployment files that are derived from one source, so they cannot drift apart.

- grafana/dashboards/llm-diag-proxy.json: the dashboard, from the panel list below.
- deploy/k8s/prometheusrule.yaml: the Prometheus Operator's PrometheusRule, from the rule groups
  of deploy/prometheus/rules/*.yml (the files the compose stack's Prometheus loads).

`python deploy/render.py` writes both; `python deploy/render.py --check` exits 1 when a committed
file differs from what this script renders (tests/deploy/test_files.py runs the check).

For a Prometheus outside the compose stack (a proxy beside a server on a host of its own),
`python deploy/render.py prometheus --proxy HOST:PORT [--proxy ...] [--vllm HOST:PORT]
[--alertmanager HOST:PORT] > prometheus.yml` prints deploy/prometheus/prometheus.yml with those
static targets and the rule files by their absolute paths in this checkout.
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

# Label selectors shared by the panels: the dashboard's job, instance and model variables.
JI = 'job=~"$job",instance=~"$instance"'
JIM = f'{JI},model=~"$model"'
REQ = "llm_proxy_requests_total"
W = "[$__rate_interval]"
# Series the dashboard falls back on where NVIDIA's DCGM exporter is scraped and the proxy's own
# NVML telemetry is not (memory in MiB there, utilization in percent).
DCGM_USED = "DCGM_FI_DEV_FB_USED * 1048576"
DCGM_FREE = "DCGM_FI_DEV_FB_FREE * 1048576"
DCGM_UTIL = "DCGM_FI_DEV_GPU_UTIL / 100"


def window_seconds(window: str) -> str:
    """A range as a number of seconds in PromQL: `[5m]` -> 300, `[$__rate_interval]` -> Grafana's ms / 1000."""
    return "300" if window == "[5m]" else "($__rate_interval_ms / 1000)"


def from_birth(metric: str, selector: str, suffix: str = "_total", window: str = W, *, per_second: bool = True) -> str:
    """The rate (or the increase) over `window` of one of the proxy's counters, or of a histogram's
    `_sum` or `_bucket`, each series counted from its birth: rate() sees no rise in a series' first
    scrape, so one the proxy created inside the window (its `_created` time) counts with its whole
    value, as deploy/prometheus/rules/recording.yml does."""
    series = f"{metric}{suffix}{{{selector}}}"
    born = f"{metric}_created{{{selector}}}"
    match = " ignoring (le)" if suffix == "_bucket" else ""
    seconds = window_seconds(window)
    whole = f"({series} and{match} ({born} > time() - {seconds}))"
    if per_second:
        return f"({whole} / {seconds} or rate({series}{window}))"
    return f"({whole} or increase({series}{window}))"


def answers_where(selector: str, window: str = W) -> str:
    """Answers per second matching `selector` (added to the variables' selector), from each series' birth."""
    return from_birth("llm_proxy_requests", f"{JIM},{selector}", window=window)


def ratio(numerator: str, denominator: str, by: str = "") -> str:
    """numerator / denominator, two rates of one counter (the numerator's series a subset of the
    denominator's): 0 where the numerator has no series, nothing where the denominator is 0."""
    group = f" by ({by})" if by else ""
    return (f"(sum{group} ({numerator}) or sum{group} ({denominator}) * 0) / "
            f"(sum{group} ({denominator}) > 0)")


def share(selector: str, by: str = "", window: str = W) -> str:
    """The share of all answers that match `selector`: numerator and denominator from one counter."""
    return ratio(answers_where(selector, window), answers_where('outcome!="not_inference"', window), by)


def records_link(query: str) -> dict[str, Any]:
    """A data link to the proxy's records for the series clicked (the admin_url variable)."""
    return {"title": "Records on the proxy", "url": "${admin_url}/api/requests?" + query, "targetBlank": True}


def target(expr: str, legend: str, ref: str, exemplar: bool = False) -> dict[str, Any]:
    result = {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref, "range": True}
    if exemplar:  # the exemplars of a histogram: each names a request, linked to its record
        result["exemplar"] = True
    return result


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
        "targets": [target(expr, legend, chr(ord("A") + n), exemplar=options.get("exemplars", False))
                    for n, (expr, legend) in enumerate(targets)],
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom, "links": options.pop("links", [])},
                        "overrides": options.pop("overrides", [])},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}} if kind == "timeseries" else
                   {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "value", "graphMode": "area", "textMode": "auto"},
    }
    options.pop("exemplars", None)
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
    return f"histogram_quantile({q}, sum by ({by}, le) ({from_birth(metric, selector, '_bucket')}))"


def counted(metric: str, selector: str = JI) -> str:
    """Events per interval of one of the proxy's counters, each series counted from its birth."""
    return from_birth(metric, selector, per_second=False)


def panels() -> list[dict[str, Any]]:
    """The dashboard, top to bottom: the verdict first, then why, then speed, memory and failures."""
    cut = answers_where('outcome="cut"')
    budget = answers_where('outcome="budget"')
    budget_reasoning = answers_where('outcome="budget",reasoning="mostly"')
    length = answers_where('stop_reason="length"')
    length_reasoning = answers_where('stop_reason="length",reasoning="mostly"')
    answers = answers_where('outcome!="not_inference"')
    rejected = counted("llm_proxy_requests", f'{JIM},stop_reason="rejected"')
    tokens = from_birth("llm_proxy_output_tokens", JIM, "_sum")
    return [
        panel("stat", "Answers cut by the serving layer (5m)", "Share of answers the serving layer ended "
              "(outcome cut: a server limit, an error, a deadline, a refusal) over the last 5 minutes. Answers "
              "that stopped at the client's own max_tokens are not cuts: they have their own figure.",
              (0, 0, 5, 4), [(share('outcome="cut"', window="[5m]"), "cut")], unit="percentunit",
              links=[records_link("outcome=cut")]),
        panel("stat", "Answers at the client's budget (5m)", "Share of answers that stopped at the max_tokens "
              "the client asked for (outcome budget): the client's choice, not a cut.", (5, 0, 5, 4),
              [(share('outcome="budget"', window="[5m]"), "budget")], unit="percentunit",
              links=[records_link("outcome=budget")]),
        panel("stat", "Answers per second", "Inference responses per second (scrapes and model listings "
              "left out).", (10, 0, 4, 4), [(f"sum({answers})", "answers/s")], unit="reqps"),
        panel("stat", "Output tokens per second", "Output tokens delivered per second through the proxy "
              "(usage when the server reports it, else counted).", (14, 0, 4, 4),
              [(f"sum({tokens})", "tokens/s")]),
        panel("stat", "In flight", "Inference requests in flight through the proxy now.", (18, 0, 3, 4),
              [(f"sum(llm_proxy_in_flight{{{JI}}})", "in flight")]),
        panel("stat", "Proxies up", "Proxy targets Prometheus scrapes successfully, of all it knows.",
              (21, 0, 3, 4), [(f"sum(up{{{JI}}})", "up"), (f"count(up{{{JI}}})", "known")]),
        row("Are answers cut, and why", 4),
        panel("timeseries", "Who ended the answers", "How answers ended, as a share of all: complete (on their "
              "own), budget (at the client's max_tokens), cut (by the serving layer), client_gone, client_error "
              "(a 4xx of the client's making), unknown (a length stop whose tokens were only counted, below the "
              "budget: the wire cannot tell). Click a series for its records.", (0, 5, 12, 8),
              [(f"sum by (outcome) ({answers})", "{{outcome}}")], unit="reqps", stacking="percent",
              links=[records_link("outcome=${__field.labels.outcome}")]),
        panel("timeseries", "Truncation ratio by cause", "Answers the serving layer cut, by cause, as a share "
              "of all answers. server_limit: a length stop below the max_tokens the client asked for (a clamped "
              "budget, the context ran out); an upstream error by kind (oom, http_5xx, reset, context_exhausted, "
              "...); deadline, rejected, interrupted. Click a series for its records.", (12, 5, 12, 8),
              [(f"sum by (cause) ({cut}) / on () group_left () (sum({answers}) > 0)", "{{cause}}")],
              unit="percentunit", links=[records_link("cause=${__field.labels.cause}")]),
        panel("timeseries", "Truncation ratio by concurrency", "Share of answers the serving layer cut, per "
              "concurrency bucket (the peak number of requests in flight during each response). Rising with "
              "the bucket: load cuts answers.", (0, 13, 12, 8),
              [(share('outcome="cut"', by="concurrency"), "c={{concurrency}}")], unit="percentunit",
              links=[records_link("outcome=cut&concurrency=${__field.labels.concurrency}")]),
        panel("timeseries", "Answers that hit the client's budget", "Share of answers that stopped at the "
              "max_tokens the client asked for, per concurrency bucket: the client's own limit, not the "
              "server's. Reasoning models: the share of those whose budget went mostly (50% or more) to "
              "thinking, so that the visible answer got what the thinking left.", (12, 13, 12, 8),
              [(share('outcome="budget"', by="concurrency"), "at budget c={{concurrency}}"),
               (ratio(budget_reasoning, budget), "of those, mostly reasoning")],
              unit="percentunit", links=[records_link("cause=requested_budget")]),
        panel("timeseries", "Output tokens by concurrency", "Median output tokens per answer by concurrency "
              "bucket, against the mean budget clients asked for. Medians that fall as concurrency rises, with "
              "the budget unchanged, mean the server shortens answers under load. Exemplars name a recent "
              "request: hover one for its record.", (0, 21, 12, 8),
              [(quantile(0.5, "llm_proxy_output_tokens", JIM), "p50 c={{concurrency}}"),
               (f"sum({from_birth('llm_proxy_requested_max_tokens', JIM, '_sum')}) / "
                f"sum({from_birth('llm_proxy_requested_max_tokens', JIM, '_count')})", "requested max_tokens (mean)")],
              exemplars=True),
        panel("timeseries", "Cuts against in-flight and GPU memory", "Answers cut by cause (left axis, share of "
              "all answers) on one time axis with the requests in flight and the GPU memory used (right axes): "
              "cuts that rise with load and with full memory show here together.", (12, 21, 12, 8),
              [(f"sum by (cause) ({cut}) / on () group_left () (sum({answers}) > 0)", "cut: {{cause}}"),
               (f"sum(llm_proxy_in_flight{{{JI}}})", "in flight"),
               (f"sum(llm_proxy_gpu_memory_used_bytes{{{JI}}}) or on () sum({DCGM_USED})", "GPU memory used")],
              unit="percentunit", overrides=[right_axis("^in flight$", "short"),
                                             right_axis("^GPU memory used$", "bytes")]),
        row("Speed under load", 29),
        panel("timeseries", "Time to first token by concurrency", "p50 and p95 of the time from request to "
              "the first content chunk, by concurrency bucket: queueing shows here first. Exemplars name a "
              "recent request.", (0, 30, 8, 8),
              [(quantile(0.5, "llm_proxy_time_to_first_token_seconds", JIM), "p50 c={{concurrency}}"),
               (quantile(0.95, "llm_proxy_time_to_first_token_seconds", JIM), "p95 c={{concurrency}}")],
              unit="s", exemplars=True),
        panel("timeseries", "Inter-token latency by concurrency", "p50 and p95 of each response's mean gap "
              "between content chunks, by concurrency bucket. Jumps with preemptions.", (8, 30, 8, 8),
              [(quantile(0.5, "llm_proxy_inter_token_latency_seconds", JIM), "p50 c={{concurrency}}"),
               (quantile(0.95, "llm_proxy_inter_token_latency_seconds", JIM), "p95 c={{concurrency}}")],
              unit="s"),
        panel("timeseries", "Throughput", "Output tokens per second by model (left axis) and answers per "
              "second (right axis), as delivered through the proxy.", (16, 30, 8, 8),
              [(f"sum by (model) ({tokens})", "tokens/s {{model}}"),
               (f"sum({answers})", "answers/s")],
              overrides=[right_axis("^answers/s$", "reqps")]),
        row("Memory and the server's own state", 38),
        panel("timeseries", "In flight vs GPU memory", "Requests in flight (left axis) and GPU memory used and "
              "free per GPU (right axis) on one time axis: where free memory runs out, at which concurrency. "
              "From the proxy's NVML telemetry, or from NVIDIA's DCGM exporter where that is what Prometheus "
              "scrapes. Ollama: VRAM per loaded model too.", (0, 39, 24, 9),
              [(f"sum(llm_proxy_in_flight{{{JI}}})", "in flight"),
               (f"llm_proxy_gpu_memory_used_bytes{{{JI}}} or on () {DCGM_USED}", "used {{instance}} gpu{{gpu}}"),
               (f"llm_proxy_gpu_memory_free_bytes{{{JI}}} or on () {DCGM_FREE}", "free {{instance}} gpu{{gpu}}"),
               (f"llm_proxy_upstream_model_vram_bytes{{{JI}}}", "model VRAM {{model}}")],
              overrides=[right_axis("^(used|free|model VRAM) .*", "bytes")]),
        panel("timeseries", "Upstream KV cache and preemptions", "The upstream's KV-cache usage (vLLM, left "
              "axis) and preemptions in each interval (right axis, from vLLM's own counter): a full cache "
              "preempts and recomputes.", (0, 48, 8, 8),
              [(f"llm_proxy_upstream_kv_cache_usage_ratio{{{JI}}}", "KV usage {{instance}}"),
               (f"increase(llm_proxy_upstream_preemptions_total{{{JI}}}{W})", "preemptions {{instance}}")],
              unit="percentunit", overrides=[right_axis("^preemptions .*", "short")]),
        panel("timeseries", "Upstream queue: running and waiting", "What the upstream says it runs and queues, "
              "against what the proxy has in flight: waiting > 0 means requests queue in the server.",
              (8, 48, 8, 8),
              [(f"llm_proxy_upstream_requests_running{{{JI}}}", "running {{instance}}"),
               (f"llm_proxy_upstream_requests_waiting{{{JI}}}", "waiting {{instance}}"),
               (f"sum(llm_proxy_in_flight{{{JI}}})", "proxy in flight")]),
        panel("timeseries", "GPU utilization", "Utilization per GPU (0-1: the proxy's NVML, or DCGM's "
              "DCGM_FI_DEV_GPU_UTIL), and whether the proxy's GPU and upstream telemetry work (1 = yes).",
              (16, 48, 8, 8),
              [(f"llm_proxy_gpu_utilization_ratio{{{JI}}} or on () {DCGM_UTIL}", "util {{instance}} gpu{{gpu}}"),
               (f"llm_proxy_gpu_telemetry_up{{{JI}}}", "GPU telemetry up {{instance}}"),
               (f"llm_proxy_upstream_telemetry_up{{{JI}}}", "upstream telemetry up {{source}}")],
              unit="percentunit"),
        row("Failures", 56),
        panel("timeseries", "Client disconnects and deadline hits", "Clients that went away (before the first "
              "token: usually their own timeout while queued) and responses past the proxy's --deadline or "
              "--idle-timeout, per interval. Records: /api/requests?stop_reason=client_disconnect, "
              "?stop_reason=deadline, ?stop_reason=idle_timeout.", (0, 57, 12, 8),
              [(f"sum by (phase) ({counted('llm_proxy_client_disconnects')})", "disconnect {{phase}}"),
               (f"sum by (kind, mode) ({counted('llm_proxy_deadline_hits')})",
                "deadline {{kind}} ({{mode}})")],
              links=[records_link("stop_reason=client_disconnect")]),
        panel("timeseries", "Upstream errors and rejections", "Upstream failures per interval by kind (oom: "
              "out of memory; context_exhausted: the KV cache / context ran out, a pool the requests share; "
              "exceeds_context: a request larger than the context one request gets; http_status: an HTTP "
              "error other than 429/503), requests the server refused "
              "(429/503: load shedding), responses the parser could not fully read, and exchanges the "
              "proxy's own code failed on (a defect of the proxy's: alert LLMProxyExchangeFailures). Records: "
              "/api/requests?stop_reason=upstream_error, ?stop_reason=rejected, ?stop_reason=proxy_error.",
              (12, 57, 12, 8),
              [(f"sum by (kind) ({counted('llm_proxy_upstream_errors')})", "{{kind}}"),
               (f"sum({rejected})", "rejected (429/503)"),
               (f"sum by (dialect) ({counted('llm_proxy_parse_errors')})", "parse error {{dialect}}"),
               (f"sum({counted('llm_proxy_exchange_failures')})", "the proxy's own failure")],
              links=[records_link("stop_reason=upstream_error")]),
        panel("timeseries", "Length stops spent on reasoning", "Of the length stops of each cause (at the "
              "client's budget, or below it: server_limit), the share whose budget went mostly (50% or more) "
              "to the model's thinking (reasoning models: delta.reasoning, thinking blocks, reasoning_tokens): "
              "the visible answer got what the thinking left. Records: /api/requests?stop_reason=length "
              "(reasoning_share).", (0, 65, 12, 7),
              [(ratio(length_reasoning, length, by="cause"), "mostly reasoning: {{cause}}")],
              unit="percentunit", links=[records_link("stop_reason=length")]),
        panel("timeseries", "Prompts cut on the way in", "Answers per interval whose prompt the server cut to "
              "fit its context (Ollama dropping the earliest messages past num_ctx, llama.cpp's context shift "
              "dropping the head of the prompt), by model: they end on their own and look complete. And the "
              "length stops the wire left open (tokens only counted), by what the server's own tokenizer made "
              "of them. Records: /api/requests?model=... (prompt_truncated).", (12, 65, 12, 7),
              [(f"sum by (model) ({counted('llm_proxy_prompt_truncated', JIM)})", "prompt cut: {{model}}"),
               (f"sum by (result) ({counted('llm_proxy_server_tokenizer_requests')})",
                "tokenizer: {{result}}")]),
        panel("timeseries", "Answers that are not whole", "Answers per interval, to requests that asked for "
              "structure, whose structured part was not whole when they ended, by model and part: tool_call (its "
              "arguments not whole JSON: cut by the budget, which vLLM reports as tool_calls, or broken below it) "
              "and json (an answer asked to be JSON that is not). Records: /api/requests?model=... "
              "(answer_complete false, incomplete_detail).", (0, 72, 24, 7),
              [(f"sum by (model, part) ({counted('llm_proxy_incomplete_answers', JIM)})", "{{part}}: {{model}}")]),
        panel("timeseries", "Queue time in the server, as it says", "How long requests waited in the server's own "
              "queue before it scheduled them, as the server measured it (vLLM's spans with --server-traces on, "
              "its per-request metrics, Ollama's durations), p50 and p95 by model: the load, measured where it "
              "happens. Records: /api/requests?model=... (queue_time_s, queue_time_source).", (0, 79, 8, 7),
              [(quantile(0.5, "llm_proxy_server_queue_seconds", JIM, by="model"), "p50 {{model}}"),
               (quantile(0.95, "llm_proxy_server_queue_seconds", JIM, by="model"), "p95 {{model}}")], unit="s"),
        panel("timeseries", "Answers the server finished that did not arrive", "Answers per interval that the "
              "server finished (its span says so) while the stream the proxy relayed broke before its end: the "
              "cut is between the server's engine and the proxy (its HTTP layer, a gateway, a load balancer, a "
              "timeout on that path). Records: /api/requests?cause=undelivered.", (8, 79, 8, 7),
              [(f"sum by (model) ({counted('llm_proxy_undelivered_answers', JIM)})", "{{model}}")],
              links=[records_link("cause=undelivered")]),
        panel("timeseries", "Server time after the client left", "For answers the server ran to their end after "
              "their client left (its span), how long it went on: capacity spent on no one (p95 by model), and "
              "how many per interval. Records: /api/requests?stop_reason=client_disconnect "
              "(server_after_disconnect_s).", (16, 79, 8, 7),
              [(quantile(0.95, "llm_proxy_server_after_disconnect_seconds", JIM, by="model"), "p95 {{model}}"),
               ("sum by (model) ("
                f"{from_birth('llm_proxy_server_after_disconnect_seconds', JIM, '_count', per_second=False)})",
                "answers {{model}}")], unit="s", overrides=[right_axis("answers .*", "short")]),
        panel("timeseries", "The proxy's admission gate", "With --max-in-flight (or PUT /api/admission): the "
              "generations waiting at the gate now, its limit, the p95 wait by model, and the refusals per interval "
              "(a full queue or a wait past --queue-timeout: 503 with Retry-After, recorded rejected). Records: "
              "/api/requests?stop_reason=rejected (stop_detail), queue_time_s with queue_time_source proxy.",
              (0, 86, 24, 7),
              [(f"sum(llm_proxy_admission_waiting{{{JI}}})", "waiting"),
               (f"max(llm_proxy_admission_limit{{{JI}}})", "limit"),
               (quantile(0.95, "llm_proxy_admission_wait_seconds", JIM, by="model"), "wait p95 {{model}}"),
               (f"sum by (reason) ({counted('llm_proxy_admission_refused')})", "refused: {{reason}}")],
              overrides=[right_axis("wait p95 .*", "s")]),
        {"type": "text", "title": "Where the records are", "gridPos": {"x": 0, "y": 93, "w": 24, "h": 4},
         "options": {"mode": "markdown", "content": (
             "Every response has a record on the proxy's admin port (the `admin_url` variable above, default "
             "http://127.0.0.1:9464): `/api/requests?outcome=cut` lists the answers the serving layer cut, "
             "`?cause=server_limit` those stopped for length below the client's budget, each with the requested "
             "budget, the output tokens, the concurrency and the GPU memory during the response. Every share "
             "here is taken from one counter, numerator and denominator alike, after summing over the selected "
             "instances: none can exceed 100%.")}},
    ]


def variable(name: str, label: str, query: str, *, every: bool = True) -> dict[str, Any]:
    result = {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
              "query": query, "definition": query, "refresh": 2, "includeAll": every, "multi": every, "sort": 1}
    if every:
        result.update({"allValue": ".*", "current": {"selected": True, "text": ["All"], "value": ["$__all"]}})
    return result


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
            # Jobs that export the proxy's metrics, whatever a deployment named them.
            {**variable("job", "Job", "label_values(llm_proxy_in_flight, job)", every=False),
             "current": {"selected": True, "text": "llm-diag-proxy", "value": "llm-diag-proxy"}},
            variable("instance", "Instance", 'label_values(up{job=~"$job"}, instance)'),
            variable("model", "Model", f'label_values({REQ}{{{JI}}}, model)'),
            {"name": "admin_url", "label": "Proxy admin URL (for record links)", "type": "textbox",
             "query": "http://127.0.0.1:9464",
             "current": {"selected": True, "text": "http://127.0.0.1:9464", "value": "http://127.0.0.1:9464"},
             "hide": 0},
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


PROMETHEUS_CONFIG = ROOT / "deploy/prometheus/prometheus.yml"


def prometheus_config(proxies: list[str], vllm: list[str] | None = None, alertmanagers: list[str] | None = None,
                      interval: str | None = None) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml for targets named by HOST:PORT instead of the compose stack's
    DNS names: the proxies' admin listeners, vLLM servers (their own /metrics), the Alertmanagers
    (none: no alerting section), every rule file by its absolute path; `interval` sets the scrape and
    evaluation intervals (the file's own 5s otherwise)."""
    config: dict[str, Any] = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    if interval is not None:
        config["global"].update(scrape_interval=interval, evaluation_interval=interval)
    config["rule_files"] = [str(PROMETHEUS_CONFIG.parent / path) for path in config["rule_files"]]
    if alertmanagers:
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": alertmanagers}]}]}
    else:
        config.pop("alerting", None)
    targets = {"llm-diag-proxy": proxies, "vllm": vllm or []}
    jobs = []
    for job in config["scrape_configs"]:
        if job["job_name"] not in targets:
            continue
        if not targets[job["job_name"]]:
            continue
        job.pop("dns_sd_configs", None)
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
        jobs.append(job)
    config["scrape_configs"] = jobs
    return config


def rendered() -> dict[Path, str]:
    return {DASHBOARD_PATH: json.dumps(dashboard(), indent=2) + "\n", PROMETHEUS_RULE_PATH: prometheus_rule()}


def prometheus_main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="deploy/render.py prometheus",
                                     description="prometheus.yml for proxies outside the compose stack")
    parser.add_argument("--proxy", action="append", required=True, metavar="HOST:PORT",
                        help="a proxy's admin listener (its /metrics); repeat for each proxy")
    parser.add_argument("--vllm", action="append", default=[], metavar="HOST:PORT", help="a vLLM server's port")
    parser.add_argument("--alertmanager", action="append", default=[], metavar="HOST:PORT")
    parser.add_argument("--interval", default=None, help="scrape and rule interval (default: the file's 5s)")
    args = parser.parse_args(argv)
    config = prometheus_config(args.proxy, args.vllm, args.alertmanager, args.interval)
    sys.stdout.write("# GENERATED by deploy/render.py prometheus from deploy/prometheus/prometheus.yml\n"
                     + yaml.dump(config, Dumper=_BlockDumper, sort_keys=False, width=120))
    return 0


def main(argv: list[str]) -> int:
    if argv[1:2] == ["prometheus"]:
        return prometheus_main(argv[2:])
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
