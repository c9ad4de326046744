"""A fleet's records in one PostgreSQL: three proxies in front of two servers write at once and
`diagnose --by instance` names the one whose server cuts answers; the database going away and
coming back costs no request; a wrong password is a clear line and the proxy serves; and two
proxies started with defaults on one machine never list each other's records."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import orjson
import pytest

from proxy.serve.app import RunningProxy, start_proxy
from proxy.simulator import SCENARIOS, start_simulator
from proxy.sweep.session import execute
from proxy.sweep.sweep_command import plan_from_args
from tests.support.postgres import PASSWORD, PostgresServer
from tests.support.proxies import ProxyFactory, proxy_config, start_served
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.wire import openai_stream

ROOT = Path(__file__).resolve().parents[2]
CHAT = {"model": "m", "stream": True, "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}


async def sweep_through(proxy: RunningProxy, model: str) -> None:
    args = type("Args", (), {"levels": (1, 2, 4, 8), "repeats": 3, "prompt": "Explain gears.", "max_tokens": 128,
                             "seed": 1, "temperature": 0.0, "timeout": 30.0, "warmup": 1})()
    plan = plan_from_args(args, proxy.proxy_url, proxy.admin_url, model)
    with open(os.devnull, "w") as quiet:
        await execute(plan, out_dir=None, report_path=None, progress=False, stdout=quiet)


async def test_three_proxies_write_one_database_and_diagnose_names_the_replica_that_cuts(
        postgres: PostgresServer) -> None:
    healthy = await start_simulator(SCENARIOS["healthy"])
    clamping = await start_simulator(SCENARIOS["clamp"])
    proxies = [await start_proxy(proxy_config(upstream.url, history_path=postgres.url(), instance=name))
               for name, upstream in (("gpu-a:8080", healthy), ("gpu-b:8080", healthy), ("gpu-c:8080", clamping))]
    try:
        await asyncio.gather(*(sweep_through(proxy, SCENARIOS["healthy"].model) for proxy in proxies))
        for proxy in proxies:
            assert proxy.history is not None and await asyncio.to_thread(proxy.history.settle, 10.0)
        async with aiohttp.ClientSession() as client:
            verdicts = []
            for proxy in proxies:  # each proxy's own live verdict: the shared records are not mixed
                async with client.get(proxy.admin_url + "/api/diagnose?min_per_level=3") as response:
                    verdicts.append(orjson.loads(await response.read()))
            async with client.get(proxies[0].admin_url + "/api/diagnose?min_per_level=3&by=instance") as response:
                fleet = orjson.loads(await response.read())
        assert [found["instance"] for found in verdicts] == ["gpu-a:8080", "gpu-b:8080", "gpu-c:8080"]
        assert [found["groups"][0]["verdict"]["kind"] for found in verdicts] == [
            "no_load_effect", "no_load_effect", "serving_defect"]
        assert fleet["comparison"].startswith("COMPARISON (by instance): instance gpu-c:8080: serving_defect")
        assert sorted(group["instance"] for group in fleet["groups"]) == ["gpu-a:8080", "gpu-b:8080", "gpu-c:8080"]
    finally:
        for proxy in proxies:
            await proxy.close()
        await healthy.close()
        await clamping.close()
    assert all(proxy.history is not None and proxy.history.dropped == 0 for proxy in proxies)
    rows = postgres.psql("SELECT instance, upstream, count(*) FROM llm_diag_records GROUP BY 1, 2 ORDER BY 1")
    assert [instance for instance, _, _ in rows] == ["gpu-a:8080", "gpu-b:8080", "gpu-c:8080"]
    assert all(count == rows[0][2] and count >= 3 * (1 + 2 + 4 + 8) for _, _, count in rows)  # and the warm-up
    assert rows[0][1] == rows[1][1] == healthy.url and rows[2][1] == clamping.url

    result = subprocess.run(
        [sys.executable, "-m", "proxy", "diagnose", "--history", postgres.url(password=None), "--by", "instance",
         "--min-per-level", "3", "--since", "1h"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False, env={**os.environ, "PGPASSWORD": PASSWORD})
    out = result.stdout
    assert result.returncode == 0, result.stderr
    assert "== instance gpu-c:8080, model sim-7b" in out and "== instance gpu-a:8080, model sim-7b" in out
    comparison = next(line for line in out.splitlines() if line.startswith("COMPARISON"))
    assert comparison.startswith("COMPARISON (by instance): instance gpu-c:8080: serving_defect")
    assert "from concurrency 4; the other 2: no load effect" in comparison, comparison
    assert PASSWORD not in out + result.stderr

    by_upstream = subprocess.run(
        [sys.executable, "-m", "proxy", "diagnose", "--history", postgres.url(), "--by", "upstream",
         "--min-per-level", "3"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert f"upstream {clamping.url}: serving_defect" in by_upstream.stdout
    assert "the other (" + healthy.url + "): no load effect" in by_upstream.stdout
    assert PASSWORD not in by_upstream.stdout and postgres.url(password="***") in by_upstream.stdout


async def test_the_database_going_away_and_back_costs_no_request_and_counts_what_it_cannot_keep(
        postgres: PostgresServer, upstream: ScriptedUpstream, make_proxy: ProxyFactory,
        client: aiohttp.ClientSession) -> None:
    upstream.default = Script(chunks=openai_stream(5), delay=0.002)
    proxy = await make_proxy(upstream.url, history_path=postgres.url(), history_buffer=40, instance="p:1")
    statuses: list[int] = []

    async def one() -> None:
        async with client.post(proxy.proxy_url + "/v1/chat/completions", json=CHAT) as response:
            body = await response.read()
            statuses.append(response.status)
            assert body.endswith(b"data: [DONE]\n\n")

    async def traffic(seconds: float) -> None:
        end = asyncio.get_running_loop().time() + seconds
        while asyncio.get_running_loop().time() < end:
            await asyncio.gather(*(one() for _ in range(4)))

    load = asyncio.create_task(traffic(6.0))
    await asyncio.sleep(1.0)
    await asyncio.to_thread(postgres.stop)
    await asyncio.sleep(2.5)
    await asyncio.to_thread(postgres.start)
    await load
    assert proxy.history is not None
    for _ in range(200):
        if proxy.history.up and proxy.history.written + proxy.history.dropped == len(statuses):
            break
        await asyncio.sleep(0.1)
    assert set(statuses) == {200} and len(statuses) > 100
    history = proxy.history
    kept = postgres.psql("SELECT count(*) FROM llm_diag_records")[0][0]
    assert kept == history.written and history.written + history.dropped == len(statuses)
    assert history.dropped > 0  # 2.5 s of traffic is more than a buffer of 40
    async with client.get(proxy.admin_url + "/metrics") as response:
        text = await response.text()
    assert f"llm_proxy_history_dropped_total {float(history.dropped)}" in text and "llm_proxy_history_up 1.0" in text


async def test_a_wrong_password_is_a_clear_line_and_the_proxy_serves(
        postgres: PostgresServer, upstream: ScriptedUpstream, tmp_path: Path, client: aiohttp.ClientSession) -> None:
    wrong = "N0t-The-Pass-42"
    upstream.default = Script(chunks=openai_stream(3))
    served = await start_served(upstream.url, tmp_path, "--history", postgres.url(password=wrong))
    try:
        async with client.post(served.proxy_url + "/v1/chat/completions", json=CHAT) as response:
            assert response.status == 200 and (await response.read()).endswith(b"[DONE]\n\n")
        answers = []
        for path in ("/readyz", "/metrics", "/api/requests", "/"):
            async with client.get(served.admin_url + path) as response:
                answers.append(await response.text())
        assert "llm_proxy_history_up 0.0" in answers[1]
        assert orjson.loads(answers[2])["source"] == "memory"
    finally:
        served.stop()
    log = served.log.read_text()
    failures = [line for line in served.lines() if line.get("event") == "history_unavailable"]
    assert len(failures) == 1 and "password authentication failed" in str(failures[0]["error"])
    assert failures[0]["history"] == postgres.url(password="***")
    assert wrong not in log and all(wrong not in answer for answer in answers)


@pytest.mark.parametrize("value", ["mysql://root:hunter2@db/x", "postgresql://u:hunter2@db:notaport/x"])
def test_a_url_that_cannot_be_used_is_one_line_and_never_a_folder(value: str, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "proxy", "serve", "--history", value], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60, check=False,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("llm-diag-proxy: error: invalid --history") and result.stderr.count("\n") == 1
    assert "hunter2" not in result.stderr and "***" in result.stderr
    assert list(tmp_path.iterdir()) == []


async def test_two_proxies_with_defaults_never_list_each_others_records_and_list_their_own_at_once(
        upstream: ScriptedUpstream, tmp_path: Path, client: aiohttp.ClientSession,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLM_DIAG_HISTORY")  # the defaults, as a user starts them
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    upstream.default = Script(chunks=openai_stream(3))
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = await start_served(upstream.url, tmp_path / "one")
    two = await start_served(upstream.url, tmp_path / "two")
    try:
        for proxy, tag in ((one, "one"), (two, "two")):
            for n in range(15):  # read-your-writes: listed as soon as it answers by id
                request_id = f"{tag}-{n}"
                async with client.post(proxy.proxy_url + "/v1/chat/completions", json=CHAT,
                                       headers={"X-Request-Id": request_id}) as response:
                    await response.read()
                async with client.get(f"{proxy.admin_url}/api/requests/{request_id}") as response:
                    assert response.status == 200
                async with client.get(f"{proxy.admin_url}/api/requests?limit=1") as response:
                    page = orjson.loads(await response.read())
                assert page["source"] == "history" and page["records"][0]["request_id"] == request_id
        for proxy, tag in ((one, "one"), (two, "two")):
            async with client.get(f"{proxy.admin_url}/api/requests?limit=100") as response:
                listed = [r["request_id"] for r in orjson.loads(await response.read())["records"]]
            assert sorted(listed) == sorted(f"{tag}-{n}" for n in range(15))
    finally:
        one.stop()
        two.stop()
    files = sorted(p.name for p in (tmp_path / "state" / "llm-diag-proxy").glob("*.sqlite3"))
    assert len(files) == 2 and all(name.startswith("history-127.0.0.1-") for name in files)
    result = subprocess.run([sys.executable, "-m", "proxy", "diagnose"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 2 and "2 proxies keep a history" in result.stderr and "--history" in result.stderr
