"""`diagnose` on recorded traffic: the simulator's presets behind a real proxy with its history on;
the verdict from the proxy's own records must name the cause the controlled sweep names, and
healthy traffic must not be blamed on load."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import pytest

from proxy.observers.history import History
from proxy.serve.app import start_proxy
from proxy.simulator import SCENARIOS, start_simulator
from proxy.sweep.live import budget_band, groups_of
from proxy.sweep.session import execute
from proxy.sweep.sweep_command import plan_from_args
from tests.support.proxies import ProxyFactory, proxy_config
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.wire import openai_stream

ROOT = Path(__file__).resolve().parents[2]


async def recorded(scenario: str, path: Path) -> tuple[str, str | None]:
    """Sweep the preset through a proxy that keeps a history; the sweep's (verdict, cause)."""
    simulator = await start_simulator(SCENARIOS[scenario])
    proxy = await start_proxy(proxy_config(simulator.url, history_path=str(path)))
    try:
        args = type("Args", (), {"levels": (1, 8), "repeats": 3, "prompt": "Explain gears.", "max_tokens": 128,
                                 "seed": 1, "temperature": 0.0, "timeout": 30.0, "warmup": 1})()
        plan = plan_from_args(args, proxy.proxy_url, proxy.admin_url, SCENARIOS[scenario].model)
        with open(os.devnull, "w") as quiet:
            outcome = await execute(plan, out_dir=None, report_path=None, progress=False, stdout=quiet)
        assert proxy.history is not None
        deadline = time.monotonic() + 10
        while proxy.history.written < len(outcome.samples) + 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        return outcome.verdict.kind, outcome.verdict.cause
    finally:
        await proxy.close()
        await simulator.close()


@pytest.fixture(scope="module")
def histories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, tuple[str, str | None]]]:
    async def all_of() -> dict[str, tuple[Path, tuple[str, str | None]]]:
        paths = {name: tmp_path_factory.mktemp(name) / "history.sqlite3" for name in ("clamp", "reject", "healthy")}
        verdicts = await asyncio.gather(*(recorded(name, path) for name, path in paths.items()))
        return {name: (paths[name], verdict) for name, verdict in zip(paths, verdicts, strict=True)}

    return asyncio.run(all_of())


@pytest.mark.parametrize("scenario", ["clamp", "reject", "healthy"])
def test_the_live_verdict_names_the_cause_the_sweep_names(
        scenario: str, histories: dict[str, tuple[Path, tuple[str, str | None]]]) -> None:
    path, (kind, cause) = histories[scenario]
    records = History(str(path), max_age_s=0, max_bytes=0).between(None)
    (group,) = groups_of(records, min_per_level=2)
    assert group.band == budget_band(128) and [s.level for s in group.summaries] == [1, 8]
    assert (group.verdict.kind, group.verdict.cause) == (kind, cause)
    if scenario == "healthy":
        assert kind == "no_load_effect"  # not blamed on load
    else:
        assert kind in ("serving_defect", "policy") and group.verdict.onset_level == 8


def test_the_command_prints_the_table_the_verdict_the_caveat_and_the_sweep_to_run(
        histories: dict[str, tuple[Path, tuple[str, str | None]]], tmp_path: Path) -> None:
    path, _ = histories["clamp"]
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "diagnose", "--history", str(path), "--since", "1h", "--min-per-level", "2",
         "--out-dir", str(tmp_path), "--report", str(tmp_path / "report.html"), "--fail-on", "serving_defect"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    out = result.stdout
    assert result.returncode == 1, result.stderr
    assert "== model " in out and "conc" in out and "VERDICT (serving_defect)" in out
    assert "observational" in out and "llm-diag-proxy sweep --target" in out and "--levels 1,8" in out
    data = orjson.loads((tmp_path / "diagnose.json").read_bytes())
    assert data["plan"]["kind"] == "diagnose (observational)" and data["verdict"]["kind"] == "serving_defect"
    assert (tmp_path / "diagnose.csv").read_text().startswith("level,index,request_id")
    page = (tmp_path / "report.html").read_text()
    assert "Live traffic by concurrency (observational)" in page and "<h1>Concurrency sweep</h1>" not in page
    healthy, _ = histories["healthy"]
    quiet = subprocess.run([sys.executable, "-m", "proxy", "diagnose", "--history", str(healthy),
                            "--min-per-level", "2", "--fail-on", "serving_defect,policy"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert quiet.returncode == 0 and "VERDICT (no_load_effect)" in quiet.stdout
    assert "llm-diag-proxy sweep --target" not in quiet.stdout


def test_too_little_traffic_is_said_plainly(tmp_path: Path) -> None:
    history = History(str(tmp_path / "empty.sqlite3"), max_age_s=0, max_bytes=0)
    assert history.open()
    history.close()
    result = subprocess.run([sys.executable, "-m", "proxy", "diagnose", "--history", str(tmp_path / "empty.sqlite3")],
                            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0 and "VERDICT (insufficient_data)" in result.stdout


def test_a_password_file_beside_a_history_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    # (taken before and read by nothing: a user who meant PostgreSQL read a file and was not told)
    (tmp_path / "password").write_text("pw\n")
    result = subprocess.run([sys.executable, "-m", "proxy", "diagnose", "--history", str(tmp_path / "h.sqlite3"),
                             "--history-password-file", str(tmp_path / "password")],
                            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("llm-diag-proxy: error: --history-password-file is the password of a "
                                    "PostgreSQL history") and result.stderr.count("\n") == 1
    assert "pw" not in result.stderr.replace("password", "")


async def test_a_running_proxy_is_read_through_its_admin_api(upstream: ScriptedUpstream,
                                                             make_proxy: ProxyFactory) -> None:
    upstream.default = Script(chunks=openai_stream(5), delay=0.05)
    proxy = await make_proxy(upstream.url)
    body = {"model": "m", "stream": True, "max_tokens": 64, "messages": [{"role": "user", "content": "x"}]}
    async with aiohttp.ClientSession() as client:
        async def one() -> None:
            async with client.post(proxy.proxy_url + "/v1/chat/completions", json=body) as response:
                await response.read()

        for _ in range(3):
            await one()
        await asyncio.gather(*(one() for _ in range(4)))
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "diagnose", "--admin", proxy.admin_url, "--min-per-level", "2",
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    out = stdout.decode()
    assert process.returncode == 0, stderr.decode()
    assert "7 records" in out and "budget 64-127: 7 answers" in out and "VERDICT (no_load_effect)" in out
