"""`llm-diag-proxy sweep` as a user runs it: flags, one-line errors, the printed table, the files."""

from __future__ import annotations

import asyncio
import csv
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest

from proxy.config import ConfigError
from proxy.simulator import SCENARIOS, start_simulator
from proxy.sweep.sweep_command import parse_levels
from tests.support.proxies import ProxyFactory
from tests.support.sweep_upstream import LoadUpstream, running_load


@pytest.fixture
async def load() -> AsyncIterator[LoadUpstream]:
    async with running_load() as server:
        yield server


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_levels_are_parsed_sorted_and_deduplicated() -> None:
    assert parse_levels("8, 1,2,4,2") == (1, 2, 4, 8)


@pytest.mark.parametrize("bad", ["", "0", "1,x", "-1", "1,,99999"])
def test_bad_levels_are_a_config_error(bad: str) -> None:
    with pytest.raises(ConfigError):
        parse_levels(bad)


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "m"], "sweep needs --target and --model"),
    (["--target", "http://127.0.0.1:1", "--model", "m", "--levels", "1,zero"], "invalid level 'zero'"),
    (["--target", "ftp://x", "--model", "m"], "the scheme must be http or https"),
    (["--target", "http://127.0.0.1:1", "--model", "m", "--repeats", "0"], "must be at least 1"),
    (["--target", "http://127.0.0.1:1", "--model", "m", "--dialect", "grpc"], "invalid choice: 'grpc'"),
])
def test_a_bad_flag_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = cli("sweep", *args)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr
    assert "Traceback" not in result.stderr


def test_a_target_that_is_down_is_one_line_and_exit_2() -> None:
    result = cli("sweep", "--target", "http://127.0.0.1:9", "--model", "m", "--no-progress")
    assert result.returncode == 2
    assert result.stderr.startswith("llm-diag-proxy: error: cannot reach the target at http://127.0.0.1:9: ")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


async def test_a_sweep_prints_the_table_and_verdict_and_writes_json_and_csv(
        load: LoadUpstream, tmp_path: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "sweep", "--target", load.url, "--model", "m", "--levels", "1,2",
        "--repeats", "2", "--max-tokens", "10", "--warmup", "0", "--out-dir", str(tmp_path / "out"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    out = stdout.decode()
    assert process.returncode == 0, stderr.decode()
    assert "conc" in out and "stop reasons" in out and "eos 4" in out
    assert "VERDICT (no_load_effect)" in out
    assert "no --admin: stop reasons come from the sweep's own parse" in out
    assert "concurrency 2: 4 responses" in stderr.decode()
    data = orjson.loads((tmp_path / "out" / "sweep.json").read_bytes())
    assert set(data) == {"plan", "levels", "verdict", "samples"}
    assert [lvl["level"] for lvl in data["levels"]] == [1, 2] and len(data["samples"]) == 6
    assert data["verdict"]["kind"] == "no_load_effect"
    rows = list(csv.DictReader((tmp_path / "out" / "sweep.csv").open()))
    assert len(rows) == 6 and {r["stop_label"] for r in rows} == {"eos"}
    assert {r["output_tokens"] for r in rows} == {"6"}


async def test_an_admin_that_does_not_know_the_requests_is_said_in_the_footer(load: LoadUpstream,
                                                                              tmp_path: Path) -> None:
    admin = LoadUpstream()  # answers /api/requests/{id} with 404, like a proxy that never saw them
    await admin.start()
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "sweep", "--target", load.url, "--admin", admin.url + "/nothing",
            "--model", "m", "--levels", "1", "--repeats", "3", "--warmup", "0", "--no-progress",
            "--out-dir", str(tmp_path), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        stdout, _ = await asyncio.wait_for(process.communicate(), 60)
    finally:
        assert admin.server is not None
        await admin.server.close()
    assert "records joined from the proxy: 0 of 3; 3 used the sweep's own record instead" in stdout.decode()


@pytest.mark.parametrize(("scenario", "code"), [("clamp", 1), ("healthy", 0)])
async def test_fail_on_gates_a_ci_job_on_the_verdict(make_proxy: ProxyFactory, tmp_path: Path, scenario: str,
                                                     code: int) -> None:
    """The simulator's clamp preset is a serving defect: `--fail-on serving_defect` exits 1 on it,
    with one line saying why, and 0 on a healthy server."""
    simulator = await start_simulator(SCENARIOS[scenario])
    try:
        proxy = await make_proxy(simulator.url)
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "sweep", "--target", proxy.proxy_url, "--admin", proxy.admin_url,
            "--model", SCENARIOS[scenario].model, "--levels", "1,8", "--repeats", "2", "--max-tokens", "128",
            "--no-progress", "--out-dir", str(tmp_path), "--fail-on", "serving_defect,policy",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        stdout, stderr = await asyncio.wait_for(process.communicate(), 90)
    finally:
        await simulator.close()
    assert process.returncode == code, (stdout.decode(), stderr.decode())
    if code:
        assert "VERDICT (serving_defect)" in stdout.decode()
        assert stderr.decode() == "llm-diag-proxy: verdict serving_defect is in --fail-on: exit 1\n"
    else:
        assert "VERDICT (no_load_effect)" in stdout.decode() and stderr.decode() == ""


@pytest.mark.parametrize("bad", ["", "serving-defect", "policy,nonsense"])
def test_an_unknown_verdict_in_fail_on_is_one_line_and_exit_2(bad: str) -> None:
    result = cli("sweep", "--target", "http://127.0.0.1:1", "--model", "m", "--fail-on", bad)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "expected a comma-separated list of insufficient_data, baseline_truncation" in result.stderr
