"""`serve --workers N` as a user runs it: N real processes on one port, one set of counts, one
/metrics and one record store for all of them, and the same deadlines and shutdown as one process."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from tests.support.proxies import Served, start_served
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.wire import openai_stream

ROOT = Path(__file__).resolve().parent.parent
CHAT = {"model": "m", "stream": True, "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}
STREAM = openai_stream(20)  # 20 tokens, one chunk each


@pytest.fixture
async def served(upstream: ScriptedUpstream, tmp_path: Path) -> AsyncIterator[Served]:
    upstream.default = Script(chunks=STREAM, delay=0.05)  # 1 s per answer
    running = await start_served(upstream.url, tmp_path, workers=2)
    yield running
    running.stop()


async def stream(url: str, request_id: str) -> tuple[int, bytes]:
    # A connection of its own per request, so that the kernel spreads them over the workers.
    headers = {"X-Request-Id": request_id}
    async with (aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session,
                session.post(url + "/v1/chat/completions", json=CHAT, headers=headers) as response):
        return response.status, await response.read()


async def metric(admin_url: str, name: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(admin_url + "/metrics") as response:
        text = await response.text()
    values = [float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)]
    return sum(values)


async def records(admin_url: str) -> list[dict[str, object]]:
    async with aiohttp.ClientSession() as session, session.get(admin_url + "/api/requests?limit=500") as response:
        found: list[dict[str, object]] = orjson.loads(await response.read())["records"]
        return found


async def test_two_workers_relay_unchanged_and_count_concurrency_proxy_wide(served: Served) -> None:
    assert len(served.children()) == 2 and await metric(served.admin_url, "llm_proxy_workers") == 2
    answers = asyncio.gather(*(stream(served.proxy_url, f"w{i}") for i in range(16)))
    await asyncio.sleep(0.6)  # all 16 are streaming now
    assert await metric(served.admin_url, "llm_proxy_in_flight") == 16  # one count for both workers
    results = await answers
    assert all(status == 200 and body == b"".join(STREAM) for status, body in results)
    await asyncio.sleep(0.3)
    found = await records(served.admin_url)
    assert sorted(r["request_id"] for r in found) == sorted(f"w{i}" for i in range(16))
    # Each saw all 16 in flight, whichever worker served it: the counts are shared, not per worker.
    assert {r["concurrency_peak"] for r in found} == {16}
    assert {r["stop_reason"] for r in found} == {"eos"} and {r["output_tokens"] for r in found} == {20}
    assert await metric(served.admin_url, "llm_proxy_requests_total") == 16
    assert await metric(served.admin_url, "llm_proxy_in_flight") == 0


async def test_sigterm_lets_open_streams_finish_in_every_worker_and_writes_their_records(served: Served) -> None:
    answers = asyncio.gather(*(stream(served.proxy_url, f"s{i}") for i in range(6)))
    await asyncio.sleep(0.3)
    served.process.send_signal(signal.SIGTERM)
    results = await answers
    assert all(status == 200 and body == b"".join(STREAM) for status, body in results)
    assert await asyncio.to_thread(served.process.wait, 40) == 0
    responses = [line for line in served.lines() if line.get("event") == "response"]
    assert sorted(str(line["request_id"]) for line in responses) == [f"s{i}" for i in range(6)]
    assert {line["stop_reason"] for line in responses} == {"eos"}
    assert any(line.get("event") == "stopped" for line in served.lines())


async def test_a_worker_that_dies_is_started_again_and_the_port_keeps_serving(served: Served) -> None:
    first = served.children()
    os.kill(first[0], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not (len(served.children()) == 2 and await metric(served.admin_url, "llm_proxy_workers") == 2):
        assert time.monotonic() < deadline, served.log.read_text()
        await asyncio.sleep(0.2)
    assert first[0] not in served.children()
    results = await asyncio.gather(*(stream(served.proxy_url, f"r{i}") for i in range(8)))
    assert all(status == 200 for status, _ in results)
    assert any(line.get("event") == "worker_died" for line in served.lines())


async def test_deadlines_are_enforced_inside_each_worker(upstream: ScriptedUpstream, tmp_path: Path) -> None:
    upstream.default = Script(chunks=STREAM, delay=0.05)
    running = await start_served(upstream.url, tmp_path, "--deadline", "0.4", "--deadline-mode", "enforce",
                                 workers=2)
    try:
        results = await asyncio.gather(*(stream(running.proxy_url, f"d{i}") for i in range(6)))
        assert all(status == 200 and len(body) < len(b"".join(STREAM)) for status, body in results)
        await asyncio.sleep(0.3)
        found = await records(running.admin_url)
        assert len(found) == 6 and {r["stop_reason"] for r in found} == {"deadline"}
        assert {r["deadline_hit"] for r in found} == {"total"}
    finally:
        running.process.send_signal(signal.SIGTERM)
        running.process.wait(timeout=40)


def test_a_bad_worker_count_is_one_line_and_exit_2() -> None:
    result = subprocess.run([sys.executable, "-m", "proxy", "serve", "--workers", "0"], cwd=ROOT,
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "--workers" in result.stderr
    result = subprocess.run([sys.executable, "-m", "proxy", "serve", "--workers", "65"], cwd=ROOT,
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2 and "expected 1 to 64" in result.stderr
