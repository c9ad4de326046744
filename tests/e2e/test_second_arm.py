"""The experiment's second arm on the built-in simulator's clamp scenario, through the proxy: without
the gate answers are cut from concurrency 4 (`serving_defect`). Its KV cache holds two full answers
(24 blocks of 16 tokens; each answer reserves 10): under `--admission 2` answers are as long at every
level as at concurrency 1 and wait at the proxy from level 4, and the verdict says the cap removes the
cut; `--admission 3` is refuted (a third answer is clamped). The sweep puts the gate back."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import aiohttp
import orjson

from proxy.serve.app import start_proxy
from proxy.simulator import SCENARIOS, start_simulator
from tests.support.proxies import proxy_config

ROOT = Path(__file__).resolve().parents[2]


async def test_the_gate_at_2_removes_the_clamps_cut_and_3_does_not(tmp_path: Path) -> None:
    simulator = await start_simulator(SCENARIOS["clamp"])
    proxy = await start_proxy(proxy_config(simulator.url, upstream_metrics="auto", admin_token="s3cret"))
    try:
        swept = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "proxy", "sweep", "--target", proxy.proxy_url, "--admin", proxy.admin_url,
            "--admin-token", "s3cret", "--model", "sim-7b", "--dialect", "ollama", "--levels", "1,2,4,8",
            "--repeats", "2", "--max-tokens", "128", "--no-progress", "--out-dir", str(tmp_path), "--admission", "2,3"],
            cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert swept.returncode == 0, swept.stderr
        text = swept.stdout
        assert "VERDICT (serving_defect)" in text and "from concurrency 4" in text, text
        assert "ADMISSION 2: removes the cut" in text and "ADMISSION 3: does not remove the cut" in text, text
        assert "at most 2 in flight keeps answers whole" in text, text
        # the advice: the highest level seen whole, with the server's own switch and the proxy's
        assert "--max-num-seqs 2" in text and "--max-in-flight 2" in text and "--admission 2" in text
        saved = orjson.loads((tmp_path / "sweep.json").read_bytes())
        arm, refuted = saved["arms"]
        assert (arm["limit"], refuted["limit"]) == (2, 3)
        first = {level["level"]: level for level in saved["levels"]}
        for level in arm["levels"]:
            assert level["completion_rate"] == 1.0
            assert level["output_tokens_median"] == first[1]["output_tokens_median"]
        assert arm["proxy_wait_p95_s"]["4"] > 0 and arm["proxy_wait_p95_s"]["8"] > 0
        assert not arm["proxy_wait_p95_s"]["1"]
        async with aiohttp.ClientSession() as session, session.get(
                proxy.admin_url + "/api/admission", headers={"Authorization": "Bearer s3cret"}) as response:
            assert (await response.json())["max_in_flight"] is None  # put back as it was
    finally:
        await proxy.close()
        await simulator.close()


async def test_compare_says_whether_a_change_removed_the_cut(tmp_path: Path) -> None:
    simulator = await start_simulator(SCENARIOS["clamp"])
    proxy = await start_proxy(proxy_config(simulator.url, upstream_metrics="auto", max_in_flight=None))
    try:
        runs = []
        for name, limit in (("before", None), ("after", 2)):
            proxy.serving.forwarder.gate.set(type(proxy.serving.forwarder.gate.settings)(max_in_flight=limit))
            out = tmp_path / name
            swept = await asyncio.to_thread(subprocess.run, [
                sys.executable, "-m", "proxy", "sweep", "--target", proxy.proxy_url, "--admin", proxy.admin_url,
                "--model", "sim-7b", "--dialect", "ollama", "--levels", "1,4", "--repeats", "2", "--max-tokens", "128",
                "--no-progress", "--out-dir", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert swept.returncode == 0, swept.stderr
            runs.append(str(out / "sweep.json"))
        compared = subprocess.run([sys.executable, "-m", "proxy", "sweep", "--compare", *runs], cwd=ROOT,
                                  capture_output=True, text=True, timeout=60)
        assert compared.returncode == 0, compared.stderr
        assert "COMPARE: the change removed the cut" in compared.stdout, compared.stdout
        assert "before" in compared.stdout and "after" in compared.stdout
        bad = subprocess.run([sys.executable, "-m", "proxy", "sweep", "--compare", runs[0], str(tmp_path / "no.json")],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    finally:
        await proxy.close()
        await simulator.close()


async def test_an_interrupted_sweep_puts_the_gate_back(tmp_path: Path) -> None:
    import signal

    simulator = await start_simulator(SCENARIOS["clamp"])
    proxy = await start_proxy(proxy_config(simulator.url, max_in_flight=7))
    gate = proxy.serving.forwarder.gate
    assert gate is not None
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "sweep", "--target", proxy.proxy_url, "--admin", proxy.admin_url,
            "--model", "sim-7b", "--dialect", "ollama", "--levels", "1,2", "--repeats", "12", "--no-progress",
            "--out-dir", str(tmp_path), "--admission", "1", cwd=ROOT, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        for _ in range(3000):  # the first arm, then the gate set to 1 for the second
            if gate.settings.max_in_flight == 1:
                break
            await asyncio.sleep(0.01)
        assert gate.settings.max_in_flight == 1
        process.send_signal(signal.SIGINT)
        await asyncio.wait_for(process.communicate(), 60)
        assert gate.settings.max_in_flight == 7  # as it was before the sweep
    finally:
        await proxy.close()
        await simulator.close()
