"""A real Prometheus, scraping every 5 s from a fresh start, counts from the first cut.

rate() and increase() see no rise in a series' first scrape: a new model's first answer cut by the
server is a series born at 1, and a sweep's burst into concurrency 4 and 8 is a set of series born
at their whole count. The rules count such series from their `_created` time
(deploy/prometheus/rules). Here, with the simulator behind one proxy and Prometheus 5 s apart as
deployed (deploy/render.py's configuration for loopback targets):

- a new model's first request, cut by the server (`server_limit`), makes LLMProxyServerLimitLengthStops
  fire;
- after two sweeps (levels 1, 2, 4, 8), the 10-minute truncation ratios by model and by concurrency
  (and the 5-minute ones the dashboard reads) are each within 0.02 of the counters' own share;
- the sweeps leave no record, metric or error of their own probes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.test_files import render
from tests.deploy.test_prometheus import PROMETHEUS, Stack, free_ports, get_json, wait_for, wait_until

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 0.02
MODEL = "fresh-model-1"  # the one model the simulator serves, never seen by the proxy before the test

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus)"),
    pytest.mark.timeout(240),
]


def counters(admin: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The proxy's own /metrics: each family's samples (labels, value)."""
    with urllib.request.urlopen(f"{admin}/metrics", timeout=5) as response:
        text = response.read().decode()
    found: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[sample.name].append((sample.labels, sample.value))
    return found


def shares(admin: str, model: str) -> tuple[float, dict[str, float], float]:
    """The counters' own share of cut answers of `model`: overall, by concurrency bucket, and the total."""
    cut: dict[str, float] = defaultdict(float)
    every: dict[str, float] = defaultdict(float)
    for labels, value in counters(admin)["llm_proxy_requests_total"]:
        if labels["model"] != model or labels["outcome"] == "not_inference":
            continue
        every[labels["concurrency"]] += value
        if labels["outcome"] == "cut":
            cut[labels["concurrency"]] += value
    total = sum(every.values())
    return sum(cut.values()) / total, {bucket: cut[bucket] / n for bucket, n in every.items()}, total


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, str, str, Path]]:
    """The simulator (its clamp scenario), one proxy in front of it, and Prometheus started afresh with
    deploy/prometheus/prometheus.yml's own 5 s intervals."""
    work = tmp_path_factory.mktemp("first-cut")
    sim_port, proxy_port, admin_port, prom_port = free_ports(4)
    admin, proxy = f"http://127.0.0.1:{admin_port}", f"http://127.0.0.1:{proxy_port}"
    config = render.prometheus_config([f"127.0.0.1:{admin_port}"])
    assert config["global"]["scrape_interval"] == "5s" and config["global"]["evaluation_interval"] == "5s"
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    assert PROMETHEUS is not None
    commands = {
        "simulator": [sys.executable, "-m", "proxy", "simulate", "--listen", f"127.0.0.1:{sim_port}",
                      "--model", MODEL],
        "proxy": [sys.executable, "-m", "proxy", "serve", "--upstream", f"http://127.0.0.1:{sim_port}",
                  "--listen", f"127.0.0.1:{proxy_port}", "--admin-listen", f"127.0.0.1:{admin_port}",
                  "--history", "off", "--log-format", "json",
                  # The proxy asks the server nothing: it cannot learn the model from the server's listing
                  # and make its series at 0 ahead, so the first cut is a series born at 1.
                  "--upstream-metrics", "off"],
        "prometheus": [PROMETHEUS, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
                       f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
    }
    ready = {"simulator": f"http://127.0.0.1:{sim_port}/health", "proxy": f"{admin}/healthz",
             "prometheus": f"http://127.0.0.1:{prom_port}/-/ready"}
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for name, command in commands.items():
            log = work / f"{name}.log"
            with log.open("ab") as out:
                processes.append(subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT))
            wait_for(ready[name], processes[-1], log)
        stack = Stack(f"http://127.0.0.1:{prom_port}", time.time(), [admin])
        wait_until(lambda: stack.series('up{job="llm-diag-proxy"} == 1'), "Prometheus scrapes the proxy", work)
        yield stack, proxy, admin, work
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def post(url: str, body: dict[str, Any]) -> bytes:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return bytes(response.read())


def firing(stack: Stack, alert: str, model: str) -> bool:
    return any(a["labels"].get("alertname") == alert and a["labels"].get("model") == model and a["state"] == "firing"
               for a in get_json(f"{stack.prometheus_url}/api/v1/alerts")["data"]["alerts"])


def test_first_cut_fires_and_sweeps_read_as_the_counters_say(fresh: tuple[Stack, str, str, Path]) -> None:
    stack, proxy, admin, work = fresh
    # A model the proxy has never seen; one answer, whose long prompt leaves the simulator's KV cache
    # room for fewer tokens than the answer needs: a server_limit cut, the only answer of its series.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea. " * 60}],
            "max_tokens": 1000, "stream": True, "stream_options": {"include_usage": True}}
    post(f"{proxy}/v1/chat/completions", body)
    (record,) = get_json(f"{admin}/api/requests?model={MODEL}")["records"]
    assert record["cause"] == "server_limit", record
    assert "stopped below the requested budget of 1,000" in record["length_cause_detail"]
    wait_until(lambda: firing(stack, "LLMProxyServerLimitLengthStops", MODEL),
               "LLMProxyServerLimitLengthStops fires for the new model's first cut", work, timeout_s=40)

    # Two sweeps through the proxy, as a person runs them: the CLI, joined with the proxy's records.
    for run in (1, 2):
        swept = subprocess.run(
            [sys.executable, "-m", "proxy", "sweep", "--target", proxy, "--admin", admin, "--model", MODEL,
             "--levels", "1,2,4,8", "--repeats", "2", "--max-tokens", "128", "--no-progress",
             "--out-dir", str(work / f"sweep-{run}")], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert swept.returncode == 0, swept.stdout + swept.stderr

    # Nothing but the sweeps' generations (and the first request) went through the proxy: no probe.
    records = get_json(f"{admin}/api/requests?limit=1000")["records"]
    assert {r["route"] for r in records} == {"/v1/chat/completions"}, {r["path"] for r in records}
    metrics = counters(admin)
    assert not any(value for _, value in metrics["llm_proxy_upstream_errors_total"])
    assert all(labels["route"] != "other" for labels, _ in metrics["llm_proxy_requests_total"])

    share, by_bucket, total = shares(admin, MODEL)
    assert share > 0.1 and len(by_bucket) >= 3, (share, by_bucket)  # the clamp cut some: there is a ratio to read
    wait_until(lambda: stack.series(f'sum(llm_proxy_requests_total{{model="{MODEL}"}}) >= {total}'),
               f"Prometheus has the proxy's final count ({total:g} answers)", work, timeout_s=20)
    time.sleep(11)  # two rule evaluations on it (5 s apart)

    def ratio(rule: str, by: str | None = None) -> dict[str, float]:
        series = stack.series(f'{rule}{{model="{MODEL}"}}')
        return {s["metric"].get(by, "") if by else "": float(s["value"][1]) for s in series}

    (by_model,) = ratio("job_model:llm_proxy_truncation_ratio:rate10m").values()
    assert abs(by_model - share) <= TOLERANCE, (by_model, share)
    for rule in ("job_model_concurrency:llm_proxy_truncation_ratio:rate10m",
                 "job_model_concurrency:llm_proxy_truncation_ratio:rate5m"):
        read = ratio(rule, "concurrency")
        assert set(read) == set(by_bucket), (rule, read, by_bucket)
        for bucket, expected in by_bucket.items():
            assert abs(read[bucket] - expected) <= TOLERANCE, (rule, bucket, read[bucket], expected)
    # The dashboard's stat reads the same share.
    panel = next(expr for title, expr in render.dashboard_expressions(render.dashboard())
                 if title == "Answers cut by the serving layer (5m)")
    query = panel.replace("$instance", ".*").replace("$model", MODEL).replace("$job", "llm-diag-proxy")
    answer = get_json(f"{stack.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": query}))
    assert abs(float(answer["data"]["result"][0]["value"][1]) - share) <= TOLERANCE
