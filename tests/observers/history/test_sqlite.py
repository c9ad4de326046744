"""The history: records in SQLite that outlive the proxy, read back through /api/requests, kept
within their age and size, and a disk that fails costs the records, never the traffic."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import orjson
from structlog.testing import capture_logs

from proxy.observers.history import History
from proxy.observers.record_store import RecordQuery
from proxy.record import ResponseRecord
from proxy.serve.app import start_proxy
from tests.support.history import record as stored_record
from tests.support.history import written_with_retention
from tests.support.proxies import ProxyFactory, proxy_config
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.wire import openai_stream

CHAT = {"model": "m", "stream": True, "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}


async def send(client: aiohttp.ClientSession, url: str, request_id: str, body: dict[str, object] = CHAT) -> None:
    async with client.post(url + "/v1/chat/completions", json=body, headers={"X-Request-Id": request_id}) as response:
        await response.read()


async def listed(client: aiohttp.ClientSession, admin_url: str, query: str = "") -> dict[str, object]:
    async with client.get(f"{admin_url}/api/requests?{query}") as response:
        assert response.status == 200, await response.text()
        found: dict[str, object] = orjson.loads(await response.read())
        return found


async def until_written(history: History, count: int) -> None:
    deadline = time.monotonic() + 10
    while history.written < count:
        assert time.monotonic() < deadline, (history.written, history.dropped)
        await asyncio.sleep(0.05)


async def test_records_survive_a_restart_and_answer_since_queries(upstream: ScriptedUpstream, tmp_path: Path,
                                                                 client: aiohttp.ClientSession) -> None:
    path = str(tmp_path / "history.sqlite3")
    upstream.default = Script(chunks=openai_stream(5))
    first = await start_proxy(proxy_config(upstream.url, history_path=path))
    started = time.time()
    for n in range(12):
        await send(client, first.proxy_url, f"h{n}", {**CHAT, "model": "m2"} if n % 3 == 0 else CHAT)
    assert first.history is not None
    await until_written(first.history, 12)
    await first.close()

    second = await start_proxy(proxy_config(upstream.url, history_path=path))  # a fresh ring, the same database
    try:
        assert len(second.store) == 0
        page = await listed(client, second.admin_url, f"since={started - 1:.3f}&limit=5")
        assert page["source"] == "history" and [r["request_id"] for r in page["records"]] == [  # type: ignore[union-attr]
            "h11", "h10", "h9", "h8", "h7"]
        rest = await listed(client, second.admin_url, f"since={started - 1:.3f}&limit=50&cursor={page['next_cursor']}")
        assert [r["request_id"] for r in rest["records"]] == [f"h{n}" for n in range(6, -1, -1)]  # type: ignore[union-attr]
        assert rest["next_cursor"] is None
        other = await listed(client, second.admin_url, "model=m2&outcome=complete&concurrency=1")
        assert sorted(r["request_id"] for r in other["records"]) == ["h0", "h3", "h6", "h9"]  # type: ignore[union-attr]
        assert (await listed(client, second.admin_url, "until=1000"))["records"] == []
        iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started - 1))
        for since in (iso, "1h", "90s"):  # ISO 8601, or an age back from now as diagnose --since takes it
            assert len((await listed(client, second.admin_url, f"since={since}&limit=50"))["records"]) == 12  # type: ignore[arg-type]
        assert (await listed(client, second.admin_url, "until=1h"))["records"] == []
        async with client.get(f"{second.admin_url}/api/requests?since=yesterday") as response:
            assert response.status == 400 and "unix seconds, ISO 8601 or an age" in await response.text()
        async with client.get(f"{second.admin_url}/api/requests/h4") as response:
            assert response.status == 200 and orjson.loads(await response.read())["stop_reason"] == "eos"
        async with client.get(f"{second.admin_url}/metrics") as response:
            assert "llm_proxy_history_up 1.0" in await response.text()
    finally:
        await second.close()


async def test_an_unwritable_history_is_one_line_and_a_metric_and_traffic_flows(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory, tmp_path: Path, client: aiohttp.ClientSession,
        capsys: object) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    proxy = await make_proxy(upstream.url, history_path=str(blocker / "history.sqlite3"))
    upstream.default = Script(chunks=openai_stream(3))
    await send(client, proxy.proxy_url, "x1")
    page = await listed(client, proxy.admin_url)
    assert page["source"] == "memory" and [r["request_id"] for r in page["records"]] == ["x1"]  # type: ignore[union-attr]
    async with client.get(f"{proxy.admin_url}/metrics") as response:
        assert "llm_proxy_history_up 0.0" in await response.text()


async def test_a_full_disk_drops_records_from_the_history_only_and_says_so(tmp_path: Path) -> None:
    history = History(str(tmp_path / "full.sqlite3"), max_age_s=0, max_bytes=0, page_limit=8)
    assert history.open()
    for n in range(400):  # a few KB each: far more than 8 pages
        history.on_response(record(f"f{n}", time.time()))
    deadline = time.monotonic() + 10
    while history.up and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not history.up and history.dropped > 0
    await asyncio.to_thread(history.close)


async def test_a_batch_the_writer_cannot_encode_is_counted_and_the_writer_goes_on(tmp_path: Path) -> None:
    """Not the database's failure but the writer's own (here a record that skipped the delivery's
    UTF-8 check): once it stopped the writer's thread for good, silently."""
    history = History(str(tmp_path / "own.sqlite3"), max_age_s=0, max_bytes=0)
    assert history.open()
    with capture_logs() as logs:
        history.on_response(stored_record("odd", time.time(), model="\ud800"))
        deadline = time.monotonic() + 10
        while history.dropped == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert history.dropped == 1 and not history.up and history.written == 0
        history.on_response(stored_record("next", time.time()))
        await until_written(history, 1)
    assert history.up and [r.request_id for r in history.page(RecordQuery()).records] == ["next"]
    failed = [line for line in logs if line["event"] == "history_write_failed"]
    assert len(failed) == 1 and "surrogates" in failed[0]["error"]
    assert [line["event"] for line in logs if line["event"] == "history_recovered"] == ["history_recovered"]
    await asyncio.to_thread(history.close)


async def test_retention_by_age_and_by_size(tmp_path: Path) -> None:
    old = History(str(tmp_path / "age.sqlite3"), max_age_s=3600, max_bytes=0)
    now = time.time()
    await written_with_retention(old, (record(f"a{n}", now - 7200 if n < 15 else now) for n in range(20)))
    assert old.count() == 5 and {r.request_id for r in old.between(None)} == {f"a{n}" for n in range(15, 20)}

    small = History(str(tmp_path / "size.sqlite3"), max_age_s=0, max_bytes=256 * 1024)
    small.retention_every_s = 0.0
    assert small.open()
    for n in range(3000):
        small.on_response(record(f"s{n}", now))
        if n % 500 == 0:
            await asyncio.sleep(0.3)
    await asyncio.to_thread(small.close)
    assert small.size_bytes() <= 2 * 256 * 1024 and 0 < small.count() < 3000
    newest = small.page(RecordQuery(limit=1)).records[0]
    assert newest.request_id == "s2999"  # the oldest go first


def record(request_id: str, started_at: float) -> ResponseRecord:
    """A record of a few KB: the size limits below count in pages."""
    return stored_record(request_id, started_at, upstream_error_detail="x" * 2000)


def test_the_cli_default_is_a_file_per_proxy_in_the_users_state_directory(tmp_path: Path) -> None:
    """Keyed by the listen address and the upstream: two proxies on one machine never share a file."""
    from proxy.config import HostPort
    from proxy.serve.cli import history_path

    os.environ["XDG_STATE_HOME"] = str(tmp_path)
    try:
        default = tmp_path / "llm-diag-proxy" / "history-127.0.0.1-8080-to-127.0.0.1-11434.sqlite3"
        assert history_path(None) == str(default)
        one = history_path(None, HostPort("127.0.0.1", 8081), "http://10.0.0.5:8000")
        other = history_path(None, HostPort("127.0.0.1", 8082), "http://10.0.0.5:8000")
        third = history_path(None, HostPort("127.0.0.1", 8081), "https://gpu-2.internal/v1")
        assert len({one, other, third}) == 3 and str(one).endswith("history-127.0.0.1-8081-to-10.0.0.5-8000.sqlite3")
        assert str(third).endswith("history-127.0.0.1-8081-to-https-gpu-2.internal-v1.sqlite3")
        ephemeral = history_path(None, HostPort("127.0.0.1", 0), "http://10.0.0.5:8000")
        assert str(ephemeral).endswith(f"-0-pid{os.getpid()}-to-10.0.0.5-8000.sqlite3")
    finally:
        del os.environ["XDG_STATE_HOME"]
    assert history_path("off") is None and history_path("/x/y.db") == "/x/y.db"


async def test_a_database_made_by_an_older_version_gets_the_new_columns_and_keeps_its_records(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.sqlite3"
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE records (seq INTEGER PRIMARY KEY AUTOINCREMENT, request_id TEXT NOT NULL,
            upstream_request_id TEXT, started_at REAL NOT NULL, model TEXT, route TEXT, stop_reason TEXT,
            length_cause TEXT, cause TEXT, outcome TEXT, concurrency TEXT, body BLOB NOT NULL);""")
    body = orjson.dumps(record("before", time.time()).to_dict())
    old.execute("INSERT INTO records (request_id, started_at, model, stop_reason, body) VALUES (?, ?, ?, ?, ?)",
                ("before", time.time(), "m", "eos", body))
    old.commit()
    old.close()
    history = History(str(path), max_age_s=0, max_bytes=0)
    assert history.open()
    history.on_response(replace(record("after", time.time()), instance="a:1", client="key:0123456789ab"))
    assert await asyncio.to_thread(history.settle, 5.0)
    await asyncio.to_thread(history.close)
    assert [r.request_id for r in history.page(RecordQuery()).records] == ["after", "before"]
    assert [r.request_id for r in history.page(RecordQuery(client="key:0123456789ab")).records] == ["after"]
    assert [r.request_id for r in history.page(RecordQuery(instance="a:1")).records] == ["after"]
