"""A real Prometheus scraping a real proxy in front of the simulator runs every query we ship.

Subprocesses on loopback: `python -m proxy simulate`, two `python -m proxy serve` in front of it
(one reading the simulator's state as vLLM, one as Ollama: two instances of one job), and
Prometheus (scrape and rule interval 1s) loading deploy/prometheus/rules with a copy of
deploy/prometheus/prometheus.yml whose targets point at them. Load through the proxies includes
answers clamped by the simulator, a 429, a 500, an out-of-memory error event, a stalled stream past
the proxy's idle timeout and a client that goes away. Then, through Prometheus' HTTP API:

- every query of the dashboard and every recording rule returns data (at least one finite sample);
- every rule evaluates without error (/api/v1/rules health ok);
- every alert expression evaluates without error, and each series selector inside it returns series.
  Alert expressions themselves mostly return nothing here: a spike needs an hour of baseline and
  thresholds held for minutes (tests/deploy/promtool covers firing and not firing);
- no ratio ever leaves [0, 1], at any evaluation from the first scrape to the last: every recording
  rule that records a ratio, the ratio inside every alert, every share on the dashboard. The load
  is built for it: steady answers first, then a burst that moves traffic into new concurrency
  buckets and new causes, then a restart of one proxy (its counters start again from 0);
- the proxy's histograms carry request ids as exemplars, which Prometheus stores (exemplar
  storage on) and serves through its query_exemplars API, and each names a real record.

Series that cannot exist on this machine are named in MAY_BE_EMPTY with the reason; GPU series are
required when the proxy's NVML telemetry works (llm_proxy_gpu_telemetry_up == 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from proxy.config import parse_duration
from tests.deploy.test_files import NAME_IN_PROMQL, render

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
RATE_INTERVAL = "1m"  # what $__rate_interval stands for here: longer than the whole test
SELECTOR = re.compile(NAME_IN_PROMQL.pattern + r"(\{[^}]*\})?")
GPU_SERIES = {"llm_proxy_gpu_memory_used_bytes", "llm_proxy_gpu_memory_free_bytes",
              "llm_proxy_gpu_memory_total_bytes", "llm_proxy_gpu_utilization_ratio"}
MAY_BE_EMPTY = {
    "llm_proxy_parse_errors_total": "the simulator's streams are well formed",
    "llm_proxy_server_tokenizer_requests_total": "every length stop of the load carries its count: none is "
                                                 "left to the server's tokenizer",
    # (each is driven in tests/e2e/test_server_traces.py and test_admission.py)
    "llm_proxy_undelivered_answers_total": "the simulator exports no request spans (--server-traces)",
    "llm_proxy_server_after_disconnect_seconds_bucket": "the simulator exports no request spans",
    "llm_proxy_server_after_disconnect_seconds_count": "the simulator exports no request spans",
    "llm_proxy_server_after_disconnect_seconds_created": "the simulator exports no request spans",
    "llm_proxy_admission_wait_seconds_bucket": "the stack's proxies run without the admission gate",
    "llm_proxy_admission_wait_seconds_created": "the stack's proxies run without the admission gate",
}

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus)"),
    pytest.mark.timeout(90),
]


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (all held open while choosing, so none repeats)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def wait_for(url: str, process: subprocess.Popen[bytes], log: Path, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{process.args} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(urllib.error.URLError, OSError), urllib.request.urlopen(url, timeout=2):
            return
        time.sleep(0.1)
    pytest.fail(f"{url} did not answer within {timeout_s}s:\n{log.read_text()[-3000:]}")


def wait_until(condition: Callable[[], object], what: str, work: Path, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting until {what}:\n" + (work / "prometheus.log").read_text()[-3000:])
        time.sleep(0.25)


@dataclass
class Stack:
    prometheus_url: str
    started: float  # epoch seconds: when Prometheus first ran
    admin_urls: list[str]
    ended: float = 0.0  # when the load and the last rule evaluations were done

    def query_range(self, expr: str, step: str = "1s") -> list[dict[str, Any]]:
        """Every evaluation of `expr` from the stack's start to the end of its load."""
        url = f"{self.prometheus_url}/api/v1/query_range?" + urllib.parse.urlencode(
            {"query": expr, "start": f"{self.started:.3f}", "end": f"{self.ended:.3f}", "step": step})
        try:
            answer: dict[str, Any] = get_json(url)
        except urllib.error.HTTPError as exc:
            answer = json.load(exc)
        assert answer["status"] == "success", f"{expr}: {answer.get('error')}"
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    def query(self, expr: str) -> dict[str, Any]:
        """The instant query's whole answer, errors included (Prometheus says 400/422 with a JSON body)."""
        url = f"{self.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            answer: dict[str, Any] = get_json(url)
        except urllib.error.HTTPError as exc:
            answer = json.load(exc)
        return answer

    def series(self, expr: str) -> list[dict[str, Any]]:
        answer = self.query(expr)
        assert answer["status"] == "success", f"{expr}: {answer.get('error')}"
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result


def prometheus_config(sim_port: int, admin_ports: list[int], interval: str = "1s") -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with loopback targets (as `deploy/render.py prometheus` renders
    it), 1s intervals, the rules by absolute path."""
    return render.prometheus_config([f"127.0.0.1:{port}" for port in admin_ports], [f"127.0.0.1:{sim_port}"],
                                    interval=interval)


# With usage in the stream, a length stop below the budget is a proven server_limit (a counted
# figure is only a lower bound: length_unknown).
CHAT = {"model": "sim-7b", "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": 128, "stream": True, "stream_options": {"include_usage": True}}


async def steady(proxy_url: str, count: int) -> None:
    """One answer at a time, more than a scrape apart: the series of concurrency 1 exist, and have
    been scraped, before the burst brings new ones."""
    async with aiohttp.ClientSession() as session:
        for n in range(count):
            body = {**CHAT, "seed": 1000 + n, "max_tokens": 16}
            async with session.post(f"{proxy_url}/v1/chat/completions", json=body) as response:
                await response.read()
            await asyncio.sleep(1.2)


async def drive_load(proxy_url: str, ollama_proxy_url: str) -> None:
    """Concurrent answers (the clamp scenario cuts some for length), then one of each fault; twice,
    more than a scrape apart, so every counter grows between two scrapes (a series first seen at 1
    has no increase that rate() can see). Ollama-dialect answers go through the second proxy."""
    url = f"{proxy_url}/v1/chat/completions"
    async with aiohttp.ClientSession() as session:

        async def answer(fault: str | None = None, seed: int = 0) -> None:
            headers = {"X-Sim-Fault": fault} if fault else {}
            async with session.post(url, json={**CHAT, "seed": seed}, headers=headers) as response:
                await response.read()

        async def walk_away() -> None:
            async with session.post(url, json=CHAT, headers={"X-Sim-Fault": "stall_after=2:3"}) as response:
                await response.content.readany()  # the first chunk, then leave

        async def ollama_answer(seed: int) -> None:
            body = {"model": "sim-7b", "messages": CHAT["messages"], "options": {"num_predict": 64, "seed": seed}}
            async with session.post(f"{ollama_proxy_url}/api/chat", json=body) as response:
                await response.read()

        for phase in range(2):
            for round_ in range(2):
                await asyncio.gather(*(answer(seed=phase * 100 + round_ * 10 + n) for n in range(8)),
                                     *(ollama_answer(seed=phase * 100 + n) for n in range(2)))
            # Three out-of-memory errors at once, after the same two tokens: a series of cut answers
            # that Prometheus first sees at 3, whatever the clamp cut in the rounds before.
            await asyncio.gather(answer("status=429"), answer("status=500"),
                                 *(answer("error_after=2:CUDA out of memory", seed=n) for n in range(3)),
                                 answer("stall_after=2:1"), walk_away(), answer(seed=99))
            await asyncio.sleep(1.5)


def proxy_requests_total(admin_url: str) -> float:
    """The proxy's own count of responses, read from its /metrics."""
    with urllib.request.urlopen(f"{admin_url}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("llm_proxy_requests_total{"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("prometheus-stack")
    sim_port, proxy_port, admin_port, ollama_port, ollama_admin_port, prom_port = free_ports(6)

    def serve(port: int, admin: int, telemetry: str) -> list[str]:
        return [sys.executable, "-m", "proxy", "serve", "--upstream", f"http://127.0.0.1:{sim_port}",
                "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}",
                "--upstream-metrics", telemetry, "--idle-timeout", "0.5", "--log-format", "json"]

    # Two proxies in one job, as two replicas would be: one polls the simulator as vLLM
    # (/metrics), the other as Ollama (/api/ps), the telemetry of the two compose profiles.
    commands = {
        "simulator": [sys.executable, "-m", "proxy", "simulate", "--listen", f"127.0.0.1:{sim_port}"],
        "proxy": serve(proxy_port, admin_port, "vllm"),
        "proxy-ollama": serve(ollama_port, ollama_admin_port, "ollama"),
    }
    admin_urls = [f"http://127.0.0.1:{admin_port}", f"http://127.0.0.1:{ollama_admin_port}"]
    (work / "prometheus.yml").write_text(
        yaml.safe_dump(prometheus_config(sim_port, [admin_port, ollama_admin_port])))
    assert PROMETHEUS is not None
    commands["prometheus"] = [PROMETHEUS, f"--config.file={work / 'prometheus.yml'}",
                              f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}",
                              "--enable-feature=exemplar-storage", "--log.level=warn"]
    ready = {"simulator": f"http://127.0.0.1:{sim_port}/health",
             "proxy": f"{admin_urls[0]}/healthz",
             "proxy-ollama": f"{admin_urls[1]}/healthz",
             "prometheus": f"http://127.0.0.1:{prom_port}/-/ready"}
    processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(name: str) -> None:
        log = work / f"{name}.log"
        with log.open("ab") as out:
            processes[name] = subprocess.Popen(commands[name], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        wait_for(ready[name], processes[name], log)

    try:
        for name in commands:
            start(name)
        running = Stack(f"http://127.0.0.1:{prom_port}", time.time(), admin_urls)
        wait_until(lambda: len(running.series("up == 1")) == 3, "Prometheus scrapes every target", work)
        asyncio.run(steady(f"http://127.0.0.1:{proxy_port}", 4))
        asyncio.run(drive_load(f"http://127.0.0.1:{proxy_port}", f"http://127.0.0.1:{ollama_port}"))
        # A restart: the second proxy's counters start again from 0 under the same target.
        processes["proxy-ollama"].terminate()
        processes["proxy-ollama"].wait(timeout=30)
        start("proxy-ollama")
        wait_until(lambda: len(running.series("up == 1")) == 3, "Prometheus scrapes the restarted proxy", work)
        asyncio.run(steady(f"http://127.0.0.1:{ollama_port}", 3))
        total = sum(proxy_requests_total(url) for url in admin_urls)
        wait_until(lambda: running.series(f'sum(llm_proxy_requests_total) >= {total}'),
                   f"Prometheus has the proxy's final count ({total:g} responses)", work)
        time.sleep(2.5)  # two rule evaluations on it (evaluation_interval 1s)
        running.ended = time.time()
        yield running
    finally:
        for process in reversed(processes.values()):
            process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def gpu_telemetry_works(stack: Stack) -> bool:
    return any(s["value"][1] == "1" for s in stack.series("llm_proxy_gpu_telemetry_up"))


def allowed_empty(stack: Stack) -> dict[str, str]:
    allowed = dict(MAY_BE_EMPTY)
    allowed.update((name.removesuffix("_total") + "_created", why) for name, why in MAY_BE_EMPTY.items())
    if not gpu_telemetry_works(stack):
        allowed.update((name, "no working NVML on this machine (llm_proxy_gpu_telemetry_up is 0)")
                       for name in GPU_SERIES)
    return allowed


def for_prometheus(expr: str, rate_interval: str = RATE_INTERVAL) -> str:
    """A dashboard query with Grafana's variables filled in as the `All` selection does, and the
    job variable at its default."""
    return (expr.replace("$instance", ".*").replace("$model", ".*").replace("$job", "llm-diag-proxy")
            .replace("$__rate_interval_ms", str(int(parse_duration(rate_interval) * 1000)))
            .replace("$__rate_interval", rate_interval))


def has_finite_sample(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in result)


def test_the_load_produced_the_truncations_the_panels_are_about(stack: Stack) -> None:
    causes = {s["metric"]["cause"] for s in stack.series("llm_proxy_truncated_total > 0")}
    assert {"server_limit", "rejected", "http_5xx", "oom"} <= causes
    outcomes = {s["metric"]["outcome"] for s in stack.series("llm_proxy_requests_total")}
    assert {"complete", "cut", "client_gone"} <= outcomes
    kinds = {s["metric"]["kind"] for s in stack.series("llm_proxy_upstream_errors_total")}
    assert {"http_status", "oom"} <= kinds
    assert stack.series('llm_proxy_deadline_hits_total{kind="idle"}')
    assert stack.series('up{job="vllm"} == 1'), "the vllm job does not scrape the simulator's /metrics"
    assert len(stack.series('up{job="llm-diag-proxy"} == 1')) == 2
    assert stack.series('llm_proxy_upstream_model_vram_bytes'), "the Ollama-polling proxy reads /api/ps"
    assert {s["metric"]["source"] for s in stack.series("llm_proxy_upstream_telemetry_up == 1")} == {
        "vllm", "ollama"}


def test_every_dashboard_query_returns_data(stack: Stack) -> None:
    allowed = allowed_empty(stack)
    board = render.dashboard()
    queries = [(f"panel {title!r}", for_prometheus(expr)) for title, expr in render.dashboard_expressions(board)]
    queries += [(f"variable {v['name']!r}", for_prometheus(re.sub(r"^label_values\((.*), \w+\)$", r"\1",
                                                                    v["query"])))
                for v in board["templating"]["list"] if v["type"] == "query"]
    empty = []
    for where, expr in queries:
        result = stack.series(expr)
        if not has_finite_sample(result) and not set(NAME_IN_PROMQL.findall(expr)) <= set(allowed) | {"up"}:
            empty.append(f"{where}: {expr}")
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_every_recording_rule_returns_data(stack: Stack) -> None:
    recorded = [rule["record"] for group in render.rule_groups() for rule in group["rules"] if "record" in rule]
    empty = [name for name in recorded if not has_finite_sample(stack.series(name))]
    assert not empty, f"recording rules without data: {empty}"


def test_every_rule_evaluates_without_error(stack: Stack) -> None:
    groups = get_json(f"{stack.prometheus_url}/api/v1/rules")["data"]["groups"]
    loaded = {rule["name"]: rule for group in groups for rule in group["rules"]}
    expected = {rule.get("record") or rule["alert"] for group in render.rule_groups() for rule in group["rules"]}
    assert set(loaded) == expected
    unhealthy = {name: rule.get("lastError") for name, rule in loaded.items() if rule["health"] != "ok"}
    assert not unhealthy


def test_every_alert_expression_evaluates_and_its_selectors_return_series(stack: Stack) -> None:
    allowed = allowed_empty(stack)
    problems = []
    for group in render.rule_groups():
        for rule in group["rules"]:
            if "alert" not in rule:
                continue
            answer = stack.query(rule["expr"])
            if answer["status"] != "success":
                problems.append(f"{rule['alert']}: {answer.get('error')}")
            for name, matchers in SELECTOR.findall(rule["expr"]):
                if name not in allowed and not stack.series(name + matchers):
                    problems.append(f"{rule['alert']}: {name}{matchers} has no series")
    assert not problems, "\n".join(problems)


def ratio_expressions() -> list[tuple[str, str]]:
    """(where, PromQL) of every ratio of answers: the recording rules that record one, the share
    inside every alert, every dashboard share."""
    found = [(f"rule {rule['record']}", rule["record"]) for group in render.rule_groups()
             for rule in group["rules"] if rule.get("record", "").endswith(("_ratio:rate5m", "_ratio:rate10m",
                                                                             "_ratio:rate1h"))]
    for group in render.rule_groups():
        for rule in group["rules"]:
            share = re.match(r"(.*?/.*?)\s*>\s*0\.\d+\s*\n\s*and", rule.get("expr", ""), re.DOTALL)
            if "alert" in rule and share and "llm_proxy_requests" in share.group(1):
                found.append((f"alert {rule['alert']}", share.group(1)))
    board = render.dashboard()
    for item in board["panels"]:
        for target in item.get("targets", []):
            shares = item["fieldConfig"]["defaults"]["unit"] == "percentunit"
            if shares and "llm_proxy_requests_total" in target["expr"]:
                found.append((f"panel {item['title']!r}", for_prometheus(target["expr"], "5s")))
    return found


def test_the_ratios_checked_are_every_kind_there_is() -> None:
    where = [w for w, _ in ratio_expressions()]
    assert sum(w.startswith("rule ") for w in where) >= 8
    assert {"alert LLMProxyUpstreamErrors", "alert LLMProxyUpstreamRejections"} <= set(where)
    assert sum(w.startswith("panel ") for w in where) >= 6


def test_no_ratio_ever_leaves_zero_to_one_through_a_burst_and_a_restart(stack: Stack) -> None:
    """Numerator and denominator from one counter: a series born at its first scrape with a count
    above 0 (a new concurrency bucket, a new cause, every series after a restart) weighs on both
    sides alike. With a numerator from a counter created at 0 up front, the burst read 255%."""
    # the load is the hard case: series of cut answers that Prometheus first saw above 1
    born_high = [series["metric"] for series in stack.query_range('llm_proxy_requests_total{outcome="cut"}')
                 if float(series["values"][0][1]) > 1]
    assert born_high, "no series of cut answers was born above 1: the burst did not test the ratios"
    outside = []
    seen = 0
    for where, expr in ratio_expressions():
        for series in stack.query_range(expr):
            for _, value in series["values"]:
                number = float(value)
                seen += 1
                if math.isnan(number) or not -1e-9 <= number <= 1 + 1e-9:
                    outside.append(f"{where} {series['metric']}: {value}")
    assert seen > 200, "the ratios had almost no evaluations to check"
    assert not outside, "ratios outside [0, 1]:\n" + "\n".join(outside[:20])


def test_histogram_exemplars_reach_prometheus_and_name_real_records(stack: Stack) -> None:
    url = f"{stack.prometheus_url}/api/v1/query_exemplars?" + urllib.parse.urlencode(
        {"query": "llm_proxy_time_to_first_token_seconds_bucket", "start": f"{stack.started:.3f}",
         "end": f"{stack.ended:.3f}"})
    answer = get_json(url)
    assert answer["status"] == "success"
    request_ids = {e["labels"]["request_id"] for series in answer["data"] for e in series["exemplars"]}
    assert request_ids, "no exemplar stored for the time-to-first-token histogram"
    found = 0
    # Every id, not a few: the restarted proxy's earlier records are gone (its ring was in memory), and
    # a few ids picked by sort order could all be among them.
    for request_id in sorted(request_ids):
        for admin in stack.admin_urls:
            try:
                record = get_json(f"{admin}/api/requests/{request_id}")
            except urllib.error.HTTPError:
                continue
            found += record["request_id"] == request_id
    assert found, "no exemplar's request id has a record on the proxies"
