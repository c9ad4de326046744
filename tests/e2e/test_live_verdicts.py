"""Verdicts on live traffic a person can act on: the sweep `diagnose` suggests goes through the port
the proxy really listens on (not the default one), repeats the shape of the cut requests (model,
dialect, prompt length, budget, levels) and runs as printed; the sweep's own reads of the server
never show up as records, metrics or errors."""

from __future__ import annotations

import asyncio
import shlex
import subprocess
import sys
from pathlib import Path

import aiohttp
import orjson

from proxy.serve.app import start_proxy
from proxy.simulator import SCENARIOS, start_simulator
from proxy.sweep.runner import SweepPlan, run_sweep
from tests.support.proxies import proxy_config

ROOT = Path(__file__).resolve().parents[2]
PROMPT = " ".join(["the sea and the ships that sail on it"] * 6)  # 54 words: the simulator counts words
BUDGET = 128


async def chat(session: aiohttp.ClientSession, proxy_url: str, seed: int) -> None:
    body = {"model": "sim-7b", "messages": [{"role": "user", "content": PROMPT}],
            "options": {"num_predict": BUDGET, "seed": seed}}
    async with session.post(f"{proxy_url}/api/chat", json=body) as response:
        await response.read()


async def test_diagnose_suggests_a_sweep_through_the_proxys_own_port_that_runs_as_printed(tmp_path: Path) -> None:
    simulator = await start_simulator(SCENARIOS["clamp"])
    proxy = await start_proxy(proxy_config(simulator.url, upstream_metrics="auto"))
    try:
        assert not proxy.proxy_url.endswith(":8080")
        async with aiohttp.ClientSession() as session:
            for seed in range(4):  # alone: each ends on its own
                await chat(session, proxy.proxy_url, seed)
            for round_ in range(2):  # eight at once: the clamp cuts them
                await asyncio.gather(*(chat(session, proxy.proxy_url, 100 + 10 * round_ + n) for n in range(8)))
        live = [r for _, r in proxy.store.snapshot()]
        prompt = sorted(r.prompt_tokens or 0 for r in live)[len(live) // 2]

        found = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "proxy", "diagnose", "--admin", proxy.admin_url, "--min-per-level", "2"],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert found.returncode == 0, found.stderr
        (line,) = [each.strip() for each in found.stdout.splitlines()
                   if each.strip().startswith("llm-diag-proxy sweep")]
        printed = shlex.split(line)
        flags = dict(zip(printed[2::2], printed[3::2], strict=True))
        assert flags["--target"] == proxy.proxy_url and flags["--admin"] == proxy.admin_url
        assert (flags["--model"], flags["--dialect"], flags["--max-tokens"], flags["--levels"]) == (
            "sim-7b", "ollama", str(BUDGET), "1,8")
        assert flags["--prompt-tokens"] == str(prompt)

        swept = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "proxy", *printed[1:], "--no-progress", "--out-dir", str(tmp_path)],
            cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert swept.returncode == 0, swept.stdout + swept.stderr
        samples = orjson.loads((tmp_path / "sweep.json").read_bytes())["samples"]
        assert samples and all(s["record_source"] == "proxy" for s in samples)
        records = [s["record"] for s in samples]
        assert {(r["dialect"], r["requested_max_tokens"]) for r in records} == {("ollama", BUDGET)}
        assert all(abs(r["prompt_tokens"] - prompt) <= 2 for r in records), sorted(r["prompt_tokens"] for r in records)
    finally:
        await proxy.close()
        await simulator.close()


async def test_a_sweep_through_the_proxy_asks_the_server_nothing_through_it() -> None:
    """No `GET /`, no `/props`, `/v1/models` or `/api/version` through the proxy port: with `--admin`
    the proxy says what its server is (`/api/about`); without it, nothing is asked at all."""
    simulator = await start_simulator(SCENARIOS["healthy"])
    proxy = await start_proxy(proxy_config(simulator.url, upstream_metrics="auto"))
    try:
        for admin in (proxy.admin_url, None):
            plan = SweepPlan(target=proxy.proxy_url, admin=admin, levels=(1, 2), repeats=1, prompt="Hi there.",
                             max_tokens=16, seed=1, model="sim-7b")
            run = await run_sweep(plan)
            assert len(run.samples) == 3
            if admin is not None:
                assert run.server is not None and run.server.context_per_request == SCENARIOS["healthy"].ctx_size
            else:
                assert run.server is None and any("asks the server nothing" in note for note in run.notes)
        records = [r for _, r in proxy.store.snapshot()]
        assert {r.route for r in records} == {"/v1/chat/completions"}, {r.path for r in records}
        assert not any(r.upstream_error for r in records)
        text = proxy.metrics.registry.get_sample_value
        assert not any(text("llm_proxy_upstream_errors_total", {"kind": kind}) for kind in ("http_status", "connect"))
    finally:
        await proxy.close()
        await simulator.close()
