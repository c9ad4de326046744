"""Admin reads run off the relay's loop: history pages and /api/diagnose in a reader process of
their own (niced, one job at a time, a bounded queue, a timeout, gone when idle or when the proxy
dies), ring pages in a thread over a copy. How little they stall a live stream is measured in
benchmarks/admin_stall.py, not here."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import pytest

from proxy.observers.history import History
from proxy.observers.record_store import RecordQuery, RecordStore, page_of
from proxy.record import ResponseRecord
from proxy.serve.admin_reads import AdminBusy, AdminReader, AdminReadFailed
from tests.support import admin_jobs
from tests.support.proxies import ProxyFactory
from tests.support.scripted_upstream import ScriptedUpstream


def record(index: int, started_at: float, level: int, output: int) -> ResponseRecord:
    return ResponseRecord(request_id=f"r{index}", method="POST", path="/v1/chat/completions",
                          route="/v1/chat/completions", dialect="openai", started_at=started_at, model="m",
                          status=200, output_tokens=output, stop_reason="length" if output < 50 else "eos",
                          requested_max_tokens=256, concurrency_peak=level, concurrency_at_start=level)


async def filled_history(path: Path, count: int) -> History:
    history = History(str(path), max_age_s=0, max_bytes=0)
    assert history.open()
    now = time.time() - 60
    for i in range(count):
        level = (1, 8)[i % 2]
        history.on_response(record(i, now + i * 0.001, level, 200 if level == 1 else 20))
    await asyncio.to_thread(history.close)
    return history


async def test_diagnose_over_the_history_is_worked_out_in_a_niced_process_of_its_own(
        tmp_path: Path, make_proxy: ProxyFactory, upstream: ScriptedUpstream) -> None:
    path = tmp_path / "history.sqlite3"
    await filled_history(path, 2000)
    proxy = await make_proxy(upstream.url, history_path=str(path))
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{proxy.admin_url}/api/diagnose", params={"since": "3600"}) as response:
            assert response.status == 200, await response.text()
            verdict = orjson.loads(await response.read())
        assert verdict["source"] == "history" and verdict["records"] == 2000
        assert [level["level"] for level in verdict["groups"][0]["levels"]] == [1, 8]
        assert verdict["groups"][0]["verdict"]["kind"] != "no_load_effect"
        reader = proxy.readers.verdicts.pid
        assert reader is not None and reader != os.getpid()
        assert int(Path(f"/proc/{reader}/stat").read_text().rsplit(")", 1)[1].split()[16]) >= 10  # nice
        async with session.get(f"{proxy.admin_url}/api/requests", params={"limit": "1000"}) as response:
            page = orjson.loads(await response.read())
        assert response.status == 200 and page["source"] == "history" and page["count"] == 1000
        assert page["records"][0]["request_id"] == "r1999" and page["next_cursor"] is not None
        async with session.get(f"{proxy.admin_url}/api/requests",
                               params={"limit": "1000", "cursor": str(page["next_cursor"])}) as response:
            rest = orjson.loads(await response.read())
        assert rest["count"] == 1000 and rest["next_cursor"] is None and rest["records"][-1]["request_id"] == "r0"
    assert proxy.readers.verdicts.answered == 1 and proxy.readers.verdicts.pid == reader  # started once
    pages = proxy.readers.pages.pid
    assert proxy.readers.pages.answered == 2 and pages not in (None, reader)  # pages have a process of their own
    await proxy.close()
    await asyncio.sleep(0.1)
    for pid in (reader, pages):
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


async def test_admin_reads_past_the_queue_are_503_admin_busy_with_retry_after(
        tmp_path: Path, make_proxy: ProxyFactory, upstream: ScriptedUpstream) -> None:
    path = tmp_path / "history.sqlite3"
    await filled_history(path, 2000)
    proxy = await make_proxy(upstream.url, history_path=str(path))
    proxy.readers.pages.waiting = proxy.readers.verdicts.waiting = 0  # one read at a time each, none waiting

    async def get(session: aiohttp.ClientSession, url: str) -> tuple[int, str | None, dict[str, object]]:
        async with session.get(url) as response:
            return response.status, response.headers.get("Retry-After"), orjson.loads(await response.read())

    async with aiohttp.ClientSession() as session:
        first = asyncio.ensure_future(get(session, f"{proxy.admin_url}/api/diagnose"))
        page = asyncio.ensure_future(get(session, f"{proxy.admin_url}/api/requests"))
        await asyncio.sleep(0.05)  # the reader processes are still starting
        status, retry, body = await get(session, f"{proxy.admin_url}/api/requests")
        assert (status, retry) == (503, "1") and body["error"]["type"] == "admin_busy"  # type: ignore[index]
        status, retry, body = await get(session, f"{proxy.admin_url}/api/diagnose")
        assert (status, retry) == (503, "1")
        assert (await first)[0] == 200 and (await page)[0] == 200
        assert (await get(session, f"{proxy.admin_url}/api/requests"))[0] == 200
        assert (await get(session, f"{proxy.admin_url}/healthz"))[0] == 200


async def test_diagnose_of_the_ring_is_sent_to_the_reader_in_batches(
        make_proxy: ProxyFactory, upstream: ScriptedUpstream) -> None:
    proxy = await make_proxy(upstream.url)  # no history: the ring is what there is
    now = time.time() - 30
    for i in range(450):
        proxy.store.on_response(record(i, now + i * 0.01, (1, 4)[i % 2], 200))
    async with aiohttp.ClientSession() as session, \
            session.get(f"{proxy.admin_url}/api/diagnose", params={"since": "600"}) as response:
        verdict = orjson.loads(await response.read())
    assert response.status == 200 and verdict["source"] == "memory" and verdict["records"] == 450
    assert verdict["groups"][0]["verdict"]["kind"] == "no_load_effect"
    assert proxy.readers.verdicts.pid not in (None, os.getpid())


async def test_a_broken_history_falls_back_to_the_ring_and_says_so(
        tmp_path: Path, make_proxy: ProxyFactory, upstream: ScriptedUpstream) -> None:
    path = tmp_path / "history.sqlite3"
    proxy = await make_proxy(upstream.url, history_path=str(path))
    proxy.store.on_response(record(1, time.time(), 1, 10))
    path.unlink()  # the reader opens it read-only: gone, it cannot
    (tmp_path / "history.sqlite3").mkdir()
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{proxy.admin_url}/api/requests") as response:
            page = orjson.loads(await response.read())
        assert response.status == 200 and page["source"] == "memory" and page["count"] == 1
        async with session.get(f"{proxy.admin_url}/api/diagnose") as response:
            verdict = orjson.loads(await response.read())
        assert response.status == 200 and verdict["source"] == "memory" and verdict["records"] == 1


async def test_one_read_runs_at_a_time_and_past_the_queue_the_answer_is_503_busy() -> None:
    reader = AdminReader(waiting=2, jobs=admin_jobs.JOBS)
    try:
        started = time.monotonic()
        jobs = [asyncio.ensure_future(reader.run("sleep", 0.3, str(i))) for i in range(3)]
        await asyncio.sleep(0)
        with pytest.raises(AdminBusy):
            await reader.run("sleep", 0, "fourth")
        answers = [orjson.loads(body) for body in await asyncio.gather(*jobs)]
        assert [a["tag"] for a in answers] == ["0", "1", "2"]
        assert len({a["pid"] for a in answers}) == 1 and answers[0]["pid"] != os.getpid()
        assert time.monotonic() - started >= 0.85  # one after another, never side by side
        assert orjson.loads(await reader.run("sleep", 0, "after"))["tag"] == "after"  # the queue drained
    finally:
        await reader.close()


async def test_a_caller_that_gives_up_does_not_leave_its_answer_for_the_next() -> None:
    reader = AdminReader(jobs=admin_jobs.JOBS)
    try:
        first = asyncio.ensure_future(reader.run("sleep", 0.3, "abandoned"))
        await asyncio.sleep(0.05)
        first.cancel()
        assert orjson.loads(await reader.run("sleep", 0, "mine"))["tag"] == "mine"
    finally:
        await reader.close()


async def test_a_read_past_its_timeout_has_its_process_killed_and_the_next_read_starts_another() -> None:
    reader = AdminReader(timeout_s=0.5, jobs=admin_jobs.JOBS)
    try:
        await reader.run("where")
        stuck = reader.pid
        with pytest.raises(AdminReadFailed) as failed:
            await reader.run("sleep", 30, "stuck")
        assert failed.value.kind == "admin_read_timeout"
        assert stuck is not None and reader.pid is None
        assert orjson.loads(await reader.run("where"))["pid"] not in (stuck, os.getpid())
    finally:
        await reader.close()


async def test_a_reader_that_dies_or_fails_answers_503_without_its_words_and_comes_back() -> None:
    reader = AdminReader(jobs=admin_jobs.JOBS)
    try:
        with pytest.raises(AdminReadFailed) as failed:
            await reader.run("die")
        assert failed.value.kind == "admin_read_failed"
        with pytest.raises(AdminReadFailed) as failed:
            await reader.run("bug")
        assert failed.value.kind == "admin_read_failed" and "secret-looking-key" not in str(failed.value)
        with pytest.raises(AdminReadFailed) as failed:
            await reader.run("broken_history")
        assert failed.value.kind == "history" and "malformed" in str(failed.value)
        assert orjson.loads(await reader.run("sleep", 0, "alive"))["tag"] == "alive"
    finally:
        await reader.close()


async def test_an_idle_reader_goes_away_and_comes_back_when_needed() -> None:
    reader = AdminReader(idle_s=0.2, jobs=admin_jobs.JOBS)
    try:
        first = orjson.loads(await reader.run("where"))["pid"]
        for _ in range(100):
            if reader.pid is None and not Path(f"/proc/{first}").exists():
                break
            await asyncio.sleep(0.05)
        assert reader.pid is None and not Path(f"/proc/{first}").exists()
        assert orjson.loads(await reader.run("where"))["pid"] != first
    finally:
        await reader.close()


READER_OF_A_KILLED_PARENT = """
import asyncio, sys
sys.path.insert(0, sys.argv[1])
from proxy.serve.admin_reads import AdminReader
from tests.support import admin_jobs

async def main():
    reader = AdminReader(jobs=admin_jobs.JOBS)
    await reader.run("where")
    print(reader.pid, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def test_the_reader_dies_with_the_proxy_even_when_the_proxy_is_killed(tmp_path: Path) -> None:
    root = str(Path(__file__).resolve().parents[2])
    parent = subprocess.Popen([sys.executable, "-c", READER_OF_A_KILLED_PARENT, root], stdout=subprocess.PIPE,
                              cwd=root)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    for _ in range(100):
        if not Path(f"/proc/{child}").exists():
            break
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists()


async def test_ring_pages_are_read_from_a_copy_and_a_cursor_starts_where_it_points() -> None:
    store = RecordStore(capacity=1000)
    for i in range(1500):
        store.on_response(record(i, 1.0 + i, 1, 10))
    snapshot = store.snapshot()
    store.on_response(record(9999, 9999.0, 1, 10))  # arrives while the copy is read: not in it
    first = page_of(snapshot, RecordQuery(limit=300))
    assert first.records[0].request_id == "r1499" and len(first.records) == 300
    second = page_of(snapshot, RecordQuery(limit=300, cursor=first.next_cursor))
    assert second.records[0].request_id == "r1199"
    assert page_of(snapshot, RecordQuery(cursor=1)).records == []  # older than anything kept
    assert page_of(snapshot, RecordQuery(limit=5, cursor=(1 << 63) - 1)).records[0].request_id == "r1499"
    assert page_of([], RecordQuery(cursor=5)).records == []
