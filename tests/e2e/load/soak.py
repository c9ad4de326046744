"""The soak: many concurrent streams through a real proxy to the simulator, mixed dialects and
faults, then a count of what was left behind (records, in-flight, tasks, memory, descriptors).

Used by tests/e2e/load (short settings) and benchmarks/soak.py (long ones). Every loop is bounded in
count and in time and ends by itself; everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from proxy.config import HostPort, ProxyConfig
from proxy.observers.hooks import Observer
from proxy.record import ResponseRecord
from proxy.serve.app import RunningProxy, start_proxy
from tests.e2e.load.resources import FdCensus, fd_census, pending_tasks, raise_fd_limit, rss_bytes, settle_memory

SCENARIOS = ("normal", "disconnect", "cut", "slow", "stall")
DEFAULT_MIX = {"normal": 0.4, "disconnect": 0.15, "cut": 0.15, "slow": 0.15, "stall": 0.15}
LOOPBACK_ANY = HostPort("127.0.0.1", 0)
_LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")


@dataclass(frozen=True, slots=True)
class SoakSettings:
    """How big and how long; the defaults are the CI size."""

    streams: int = 1000  # concurrent workers, each with one stream open at a time
    requests_per_worker: int = 1  # upper bound of the measured phase, per worker
    duration_s: float = 0.0  # the measured phase also ends after this long (0 = count only)
    tokens: int = 8  # mean natural answer length (uniform within +-25 %)
    token_time_s: float = 0.4  # slow tokens: many streams held open at a modest chunk rate
    stall_s: float = 2.0
    idle_timeout_s: float = 1.0  # observe mode: a stall of stall_s must show as deadline_hit=idle
    slow_read: tuple[int, float] = (32, 0.1)  # a slow client reads this many bytes, then sleeps this long
    ring_size: int = 1500
    seed: int = 1
    mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    request_timeout_s: float = 120.0  # a client gives up on one request after this


@dataclass(frozen=True, slots=True)
class Plan:
    request_id: str
    dialect: str  # openai | ollama
    scenario: str
    at: int  # disconnect after `at` events; cut or stall after `at` tokens


@dataclass
class PhaseFigures:
    requests: int
    seconds: float
    peak_in_flight: int
    ring_max: int
    by_scenario: dict[str, int]
    by_stop_reason: dict[str, int]
    rss_timeline: list[tuple[float, float, int]] = field(default_factory=list)


@dataclass
class SoakReport:
    settings: SoakSettings
    warmup: PhaseFigures | None = None
    measured: PhaseFigures | None = None
    rss_start_mib: float = 0.0
    rss_before_mib: float = 0.0
    rss_peak_mib: float = 0.0
    rss_after_mib: float = 0.0
    fds_before: FdCensus | None = None
    fds_after: FdCensus | None = None
    fds_free_before: int = 0
    fds_free_after: int = 0
    records_seen: int = 0
    duplicates: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    client_errors: list[str] = field(default_factory=list)
    in_flight_after: int = -1
    in_flight_gauge_after: float = -1.0
    pending_tasks_after: list[str] = field(default_factory=list)
    store_len: int = 0
    store_total: int = 0
    fd_soft_limit: int = 0
    proxy_port: int = 0
    upstream_port: int = 0
    disconnects_after_hand_over: int = 0  # recorded `eos`: the whole answer was written first
    server_errors: list[str] = field(default_factory=list)  # aiohttp's own error log lines (tracebacks)

    def lines(self) -> list[str]:
        """The figures, one per line, for a test's output and docs/reliability.md."""
        s, w, m = self.settings, self.warmup, self.measured
        out = [f"streams (concurrent workers): {s.streams}; fd soft limit {self.fd_soft_limit}"]
        for name, phase in (("warm-up", w), ("measured", m)):
            if phase is not None:
                out.append(f"{name}: {phase.requests} requests in {phase.seconds:.1f} s, peak in flight "
                           f"{phase.peak_in_flight}, ring max {phase.ring_max}/{s.ring_size}")
                out.append(f"  scenarios {phase.by_scenario}")
                out.append(f"  stop reasons {phase.by_stop_reason}")
                if len(phase.rss_timeline) > 1:
                    out.append("  RSS MiB every 30 s: " + ", ".join(
                        f"{seconds:.0f}s {mib:.1f} ({records} rec)" for seconds, mib, records in phase.rss_timeline))
        out.append(f"records: {self.records_seen} seen, {len(self.duplicates)} duplicated, {len(self.missing)} "
                   f"missing, {len(self.wrong)} with an unexpected diagnosis; store {self.store_len}/"
                   f"{s.ring_size} (total {self.store_total}); {self.disconnects_after_hand_over} hang-ups "
                   f"came after the whole answer was handed over (eos)")
        out.append(f"in flight after: tracker {self.in_flight_after}, gauge {self.in_flight_gauge_after:g}; "
                   f"pending tasks after: {len(self.pending_tasks_after)}")
        out.append(f"RSS MiB: start {self.rss_start_mib:.1f}, after warm-up {self.rss_before_mib:.1f}, "
                   f"peak {self.rss_peak_mib:.1f}, after {self.rss_after_mib:.1f} "
                   f"(growth {self.rss_after_mib - self.rss_before_mib:+.1f})")
        if self.fds_before is not None and self.fds_after is not None:
            out.append(f"fds not on the upstream pool: before {self.fds_free_before}, after {self.fds_free_after}; "
                       f"total before {self.fds_before.total}, after {self.fds_after.total}; "
                       f"after: non-socket {self.fds_after.non_socket}, listening {self.fds_after.listening}, "
                       f"sockets by port {self.fds_after.touching}")
        out.append(f"errors logged by the proxy's HTTP server: {len(self.server_errors)}")
        if self.client_errors:
            out.append(f"client errors (first 5 of {len(self.client_errors)}): {self.client_errors[:5]}")
        if self.wrong:
            out.append(f"unexpected diagnoses (first 5 of {len(self.wrong)}): {self.wrong[:5]}")
        return out


class ErrorLogCounter(logging.Handler):
    """Collects aiohttp's own ERROR log lines: a routine disconnect must never log a traceback."""

    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.ERROR)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        detail = f" ({record.exc_info[0].__name__})" if record.exc_info and record.exc_info[0] else ""
        self.into.append(f"{record.name}: {record.getMessage()}{detail}"[:200])


class RecordCounter(Observer):
    """An observer that keeps each finished record until its worker checks it.

    Request ids are `PHASE-WORKER-N` and each worker checks its requests in order, so a second
    record for a request shows as an N at or below the worker's last checked one: the counter
    holds one number per worker, not one id per request (the soak measures the proxy, not itself).
    """

    def __init__(self) -> None:
        self.pending: dict[str, ResponseRecord] = {}
        self.last_taken: dict[str, int] = {}  # PHASE-WORKER -> the last N checked
        self.taken = 0
        self.duplicates: list[str] = []
        self.arrived = asyncio.Event()

    def on_response_start(self, record: ResponseRecord) -> None:
        pass

    def on_response(self, record: ResponseRecord) -> None:
        rid = record.request_id
        worker, _, n = rid.rpartition("-")
        if rid in self.pending or (n.isdigit() and int(n) <= self.last_taken.get(worker, -1)):
            self.duplicates.append(rid)
            return
        self.pending[rid] = record
        self.arrived.set()

    async def take(self, request_id: str, wait_s: float) -> ResponseRecord | None:
        """The record of `request_id`, waiting for it up to `wait_s` (None if it never came)."""
        deadline = time.monotonic() + wait_s
        while request_id not in self.pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self.arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.arrived.wait(), min(remaining, 0.05))
        worker, _, n = request_id.rpartition("-")
        self.last_taken[worker] = int(n)
        self.taken += 1
        return self.pending.pop(request_id)


def simulator_args(settings: SoakSettings) -> list[str]:
    """`simulate` flags: nothing runs out and batches do not slow down, so only the scripted
    faults end answers early."""
    return ["--scenario", "healthy", "--listen", "127.0.0.1:0", "--token-time", f"{settings.token_time_s:g}",
            "--batch-slowdown", "0", "--prefill-time", "0", "--natural-tokens", str(settings.tokens),
            "--kv-blocks", "0", "--kv-policy", "none", "--max-num-seqs", str(max(256, settings.streams * 2)),
            "--seed", str(settings.seed)]


@contextlib.asynccontextmanager
async def simulator_process(settings: SoakSettings) -> AsyncIterator[str]:
    """`python -m proxy simulate` in its own process (so this process's counts are the proxy's
    alone); yields its base URL. Its stderr goes to a temporary file, never to a full pipe."""
    with tempfile.TemporaryFile() as log:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "simulate", *simulator_args(settings),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=log)
        try:
            url = None
            for _ in range(400):  # bounded: 20 s for the simulator to listen
                log.seek(0)
                found = _LISTENING.search(log.read().decode(errors="replace"))
                if found:
                    url = found.group(1)
                    break
                if process.returncode is not None:
                    break
                await asyncio.sleep(0.05)
            if url is None:
                log.seek(0)
                raise RuntimeError(f"the simulator did not start: {log.read()[-500:]!r}")
            yield url
        finally:
            if process.returncode is None:
                process.terminate()
                try:
                    await asyncio.wait_for(process.wait(), 10)
                except TimeoutError:
                    process.kill()
                    await process.wait()


def proxy_settings(upstream: str, settings: SoakSettings) -> ProxyConfig:
    return ProxyConfig(upstream=upstream, listen=LOOPBACK_ANY, admin_listen=LOOPBACK_ANY,
                       idle_timeout_s=settings.idle_timeout_s, deadline_mode="observe",
                       ring_size=settings.ring_size, gpu_poll_interval_s=0, upstream_metrics="off",
                       log_records=False)


def plan_request(rng: random.Random, request_id: str, settings: SoakSettings) -> Plan:
    scenarios = list(settings.mix)
    scenario = rng.choices(scenarios, weights=[settings.mix[s] for s in scenarios])[0]
    lowest = max(4, int(settings.tokens * 0.75))  # the shortest natural answer
    at = rng.randrange(0, max(1, lowest // 2)) if scenario == "disconnect" else rng.randrange(1, max(2, lowest // 2))
    return Plan(request_id, rng.choice(("openai", "ollama")), scenario, at)


def expected(plan: Plan) -> str:
    """The stop reason the proxy must record for a plan."""
    return {"disconnect": "client_disconnect", "cut": "upstream_disconnect"}.get(plan.scenario, "eos")


def _request(plan: Plan, settings: SoakSettings) -> tuple[str, dict[str, Any], dict[str, str]]:
    headers = {"X-Request-Id": plan.request_id}
    if plan.scenario == "cut":
        headers["X-Sim-Fault"] = f"cut_after={plan.at}"
    elif plan.scenario == "stall":
        headers["X-Sim-Fault"] = f"stall_after={plan.at}:{settings.stall_s:g}"
    budget = settings.tokens * 2
    messages = [{"role": "user", "content": "tell me a short story"}]
    if plan.dialect == "openai":
        return "/v1/chat/completions", {"model": "sim-7b", "messages": messages, "stream": True,
                                        "max_tokens": budget}, headers
    return "/api/chat", {"model": "sim-7b", "messages": messages, "stream": True,
                         "options": {"num_predict": budget}}, headers


async def run_one(session: aiohttp.ClientSession, base: str, plan: Plan, settings: SoakSettings) -> str | None:
    """Play one plan as a client; returns a one-line problem, or None when the client saw what it should."""
    path, body, headers = _request(plan, settings)
    try:
        async with asyncio.timeout(settings.request_timeout_s):
            async with session.post(base + path, json=body, headers=headers) as response:
                if response.status != 200:
                    return f"{plan.request_id}: HTTP {response.status}"
                if plan.scenario == "disconnect":
                    for _ in range(plan.at):
                        if not await response.content.readline():
                            return f"{plan.request_id}: stream ended before the planned disconnect"
                    response.close()  # drop the connection mid-stream
                    return None
                if plan.scenario == "slow":
                    size, pause = settings.slow_read
                    while await response.content.read(size):
                        await asyncio.sleep(pause)
                    return None
                data = await response.read()
                if plan.scenario == "cut":
                    return f"{plan.request_id}: a cut stream ended cleanly ({len(data)} bytes)"
                return None
    except aiohttp.ClientPayloadError:
        return None if plan.scenario == "cut" else f"{plan.request_id}: payload error"
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
        return f"{plan.request_id}: {type(exc).__name__}: {exc}"[:200]


def handed_over(plan: Plan, record: ResponseRecord) -> bool:
    """A planned disconnect that came after the proxy had handed over the whole answer.

    The rest of the answer sits in the client's socket buffer, unread: the upstream ended it on
    its own and every byte was written before the proxy could see the hang-up (the FIN had not
    arrived yet). `eos` is then the truth about the answer.
    """
    return (plan.scenario == "disconnect" and record.stop_reason == "eos" and not record.client_disconnected
            and record.finish_reason_raw is not None)


def check_record(plan: Plan, record: ResponseRecord) -> str | None:
    """A one-line problem when the record's diagnosis is not what the plan made happen."""
    want = expected(plan)
    if handed_over(plan, record):
        return None
    if record.stop_reason != want:
        return f"{plan.request_id} ({plan.dialect} {plan.scenario}@{plan.at}): {record.stop_reason}, want {want}"
    if plan.scenario == "cut" and record.upstream_error != "reset":
        return f"{plan.request_id}: cut recorded upstream_error={record.upstream_error}"
    if plan.scenario == "stall" and record.deadline_hit != "idle":
        return f"{plan.request_id}: stall of {record.itl_max_s}s recorded deadline_hit={record.deadline_hit}"
    return None


class _Sampler:
    """Samples in-flight count, ring length and RSS every 50 ms while a phase runs."""

    TIMELINE_EVERY_S = 30.0

    def __init__(self, running: RunningProxy) -> None:
        self.running = running
        self.peak_in_flight = 0
        self.ring_max = 0
        self.rss_peak = 0
        self.timeline: list[tuple[float, float, int]] = []  # (seconds, RSS MiB, records so far)
        self._stop = asyncio.Event()

    async def run(self) -> None:
        started = next_mark = time.monotonic()
        while not self._stop.is_set():
            self.peak_in_flight = max(self.peak_in_flight, self.running.concurrency.in_flight)
            self.ring_max = max(self.ring_max, len(self.running.store))
            rss = rss_bytes()
            self.rss_peak = max(self.rss_peak, rss)
            if time.monotonic() >= next_mark:
                self.timeline.append((time.monotonic() - started, rss / (1 << 20), self.running.store.total))
                next_mark += self.TIMELINE_EVERY_S
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 0.05)

    def stop(self) -> None:
        self._stop.set()


async def run_phase(running: RunningProxy, counter: RecordCounter, settings: SoakSettings, name: str,
                    per_worker: int, duration_s: float, report: SoakReport) -> PhaseFigures:
    """`settings.streams` workers, each running up to `per_worker` requests (and stopping once
    `duration_s` has passed, when set); each checks the record of its request as it comes."""
    rng = random.Random(f"{settings.seed}-{name}")
    scenarios: Counter[str] = Counter()
    stops: Counter[str] = Counter()
    started = time.monotonic()
    ends_at = started + duration_s if duration_s else None
    sampler = _Sampler(running)
    sampling = asyncio.create_task(sampler.run(), name="soak-sampler")
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:

        async def worker(index: int) -> None:
            for n in range(per_worker):
                if ends_at is not None and time.monotonic() >= ends_at:
                    return
                plan = plan_request(rng, f"{name}-{index}-{n}", settings)
                scenarios[plan.scenario] += 1
                problem = await run_one(session, running.proxy_url, plan, settings)
                if problem is not None:
                    report.client_errors.append(problem)
                record = await counter.take(plan.request_id, 10.0)  # the handler may still be finishing
                if record is None:
                    report.missing.append(plan.request_id)
                    continue
                stops[record.stop_reason] += 1
                if handed_over(plan, record):
                    report.disconnects_after_hand_over += 1
                problem = check_record(plan, record)
                if problem is not None:
                    report.wrong.append(problem)

        await asyncio.gather(*(worker(i) for i in range(settings.streams)))
    seconds = time.monotonic() - started
    for _ in range(400):  # bounded: the last handlers release their in-flight slot
        if running.concurrency.in_flight == 0:
            break
        await asyncio.sleep(0.025)
    sampler.stop()
    await sampling
    report.rss_peak_mib = max(report.rss_peak_mib, sampler.rss_peak / (1 << 20))
    return PhaseFigures(sum(scenarios.values()), seconds, sampler.peak_in_flight, sampler.ring_max,
                        dict(scenarios), dict(stops), sampler.timeline)


async def _settle(running: RunningProxy, proxy_port: int, baseline: set[asyncio.Task[object]]) -> None:
    """Wait (bounded) until the proxy's client-side sockets are closed and stray tasks are gone."""
    for _ in range(200):
        census = fd_census((proxy_port,))
        if census.touching[proxy_port] == 0 and not (pending_tasks() - baseline):
            return
        await asyncio.sleep(0.025)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def run_soak(settings: SoakSettings) -> SoakReport:
    """Start the simulator (its own process) and a proxy (this one), then measure the proxy."""
    report = SoakReport(settings)
    report.fd_soft_limit = raise_fd_limit(max(4096, settings.streams * 6 + 512))
    report.rss_start_mib = settle_memory() / (1 << 20)
    counter = RecordCounter()
    errors = ErrorLogCounter(report.server_errors)
    server_log = logging.getLogger("aiohttp")
    server_log.addHandler(errors)
    try:
        async with simulator_process(settings) as simulator_url:
            running = await start_proxy(proxy_settings(simulator_url, settings), extra_observers=(counter,))
            try:
                await _measure(running, counter, settings, report,
                               (_port(running.proxy_url), _port(simulator_url)))
            finally:
                await running.close()
    finally:
        server_log.removeHandler(errors)
    return report


async def _measure(running: RunningProxy, counter: RecordCounter, settings: SoakSettings, report: SoakReport,
                   ports: tuple[int, int]) -> None:
    """Warm up (until the ring is full), take the baseline, run the soak, measure again."""
    report.proxy_port, report.upstream_port = ports
    baseline_tasks = pending_tasks()
    # the warm-up fills the ring, so the baseline already holds as many records as the end will
    warmup_per_worker = max(1, -(-settings.ring_size // settings.streams))
    report.warmup = await run_phase(running, counter, settings, "warmup", warmup_per_worker, 0.0, report)
    await _settle(running, ports[0], baseline_tasks)
    report.rss_before_mib = settle_memory() / (1 << 20)
    report.fds_before = fd_census(ports)
    report.fds_free_before = report.fds_before.without(*ports)
    report.measured = await run_phase(running, counter, settings, "soak", settings.requests_per_worker,
                                      settings.duration_s, report)
    await _settle(running, ports[0], baseline_tasks)
    report.rss_after_mib = settle_memory() / (1 << 20)
    report.fds_after = fd_census(ports)
    report.fds_free_after = report.fds_after.without(*ports)
    report.pending_tasks_after = sorted(repr(t.get_coro())[:120] for t in pending_tasks() - baseline_tasks)
    report.records_seen = counter.taken + len(counter.duplicates) + len(counter.pending)
    report.duplicates = list(counter.duplicates)
    report.missing += sorted(counter.pending)  # records of requests no worker planned
    report.in_flight_after = running.concurrency.in_flight
    gauge = running.metrics.registry.get_sample_value("llm_proxy_in_flight")
    report.in_flight_gauge_after = -1.0 if gauge is None else gauge
    report.store_len, report.store_total = len(running.store), running.store.total
