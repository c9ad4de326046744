"""One build, one or N processes: the same traffic through `serve` and `serve --workers 2`, the history
on and off, reads the same through the admin listener.

- read-your-writes: a record is there the moment its answer has been read, by its id and in the listing;
- every record listed once: pages by cursor over both workers' rings (or the history) give each
  record exactly once, with no gap;
- `/metrics` counts every answer once, summed over the workers;
- a worker killed after its answers keeps its counts in the sum (its last snapshot), and the
  records it delivered stay listed in the history.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from tests.support.proxies import Served, start_served
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.wire import openai_stream

CHAT = {"model": "m", "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
ANSWERS = 24


@pytest.fixture(params=[(1, False), (1, True), (2, False), (2, True)], ids=["one-memory", "one-history",
                                                                             "two-memory", "two-history"])
async def served(request: pytest.FixtureRequest, upstream: ScriptedUpstream, tmp_path: Path) -> AsyncIterator[Served]:
    workers, history = request.param
    upstream.default = Script(chunks=openai_stream(5), delay=0.01)
    flags = ["--history", str(tmp_path / "history.sqlite3") if history else "off"]
    running = await start_served(upstream.url, tmp_path, *flags, workers=workers)
    yield running
    running.stop()


async def answer_and_read_back(session: aiohttp.ClientSession, served: Served, request_id: str) -> None:
    """One answer read whole, then its record asked for at once, by id."""
    async with (aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as own,
                own.post(served.proxy_url + "/v1/chat/completions", json=CHAT,
                         headers={"X-Request-Id": request_id}) as response):
        assert response.status == 200
        await response.read()
    async with session.get(f"{served.admin_url}/api/requests/{request_id}") as found:
        assert found.status == 200, await found.text()
        assert orjson.loads(await found.read())["request_id"] == request_id


async def every_page(session: aiohttp.ClientSession, served: Served, limit: int) -> list[dict[str, object]]:
    records: list[dict[str, object]] = []
    cursor = None
    for _ in range(100):
        url = f"{served.admin_url}/api/requests?limit={limit}" + (f"&cursor={cursor}" if cursor is not None else "")
        async with session.get(url) as response:
            page = orjson.loads(await response.read())
        records += page["records"]
        cursor = page["next_cursor"]
        if cursor is None:
            return records
    raise AssertionError("the pages never ended")


def rows_in(database: Path) -> int:
    """The records the history database holds now (read beside its writers, as SQLite allows)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=5)) as db:
            (count,) = db.execute("SELECT count(*) FROM records").fetchone()
    except sqlite3.OperationalError:  # not made yet
        return 0
    return int(count)


async def counted(session: aiohttp.ClientSession, served: Served, name: str) -> float:
    async with session.get(served.admin_url + "/metrics") as response:
        text = await response.text()
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


async def test_every_record_is_read_back_at_once_listed_once_and_counted_once(served: Served) -> None:
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(answer_and_read_back(session, served, f"a{i:02d}") for i in range(ANSWERS)))
        for limit in (5, 1000):
            found = await every_page(session, served, limit)
            ids = [str(r["request_id"]) for r in found]
            assert sorted(ids) == [f"a{i:02d}" for i in range(ANSWERS)], ids  # each once, none missing
        assert await counted(session, served, "llm_proxy_requests_total") == ANSWERS
        assert await counted(session, served, "llm_proxy_records_lost_total") == 0


async def test_a_killed_worker_keeps_its_counts_in_the_sum(upstream: ScriptedUpstream, tmp_path: Path) -> None:
    upstream.default = Script(chunks=openai_stream(5), delay=0.01)
    served = await start_served(upstream.url, tmp_path, "--history", str(tmp_path / "h.sqlite3"), workers=2)
    try:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(answer_and_read_back(session, served, f"k{i:02d}") for i in range(ANSWERS)))
            # Killed once every record is written (in the database) and counted (a scrape asks each
            # worker for its snapshot): waited for, not slept on, for a loaded machine is slower.
            deadline = time.monotonic() + 30
            while (rows_in(tmp_path / "h.sqlite3") < ANSWERS
                   or await counted(session, served, "llm_proxy_requests_total") < ANSWERS):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.2)  # (the writer counts a batch kept just after its commit)
            os.kill(served.children()[0], signal.SIGKILL)
            deadline = time.monotonic() + 60
            while not any(line.get("event") == "worker_died" for line in served.lines()):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)
            assert await counted(session, served, "llm_proxy_requests_total") == ANSWERS
            died = next(line for line in served.lines() if line.get("event") == "worker_died")
            assert died["records_lost"] == 0 and died["records_uncounted"] == 0
            assert len(await every_page(session, served, 1000)) == ANSWERS  # in the history, all of them
            while await counted(session, served, "llm_proxy_workers") < 2:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            await answer_and_read_back(session, served, "after")
            assert await counted(session, served, "llm_proxy_requests_total") == ANSWERS + 1
    finally:
        served.stop()
