"""A history holding rows another version wrote (a newer proxy of a fleet on one PostgreSQL, a
rolling upgrade that adds a stop reason, a damaged row) still serves `/api/requests`,
`/api/diagnose` and `diagnose`: each row is read as far as this version can, a row that holds no
record is counted and left out, and no row fails a page."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson

from proxy.observers.history import History
from proxy.record import record_from_stored
from proxy.serve.app import start_proxy
from tests.support.history import record
from tests.support.proxies import proxy_config

ROOT = Path(__file__).resolve().parents[3]


def newer(request_id: str, started_at: float) -> dict[str, object]:
    """The body a later version might write: a stop reason and a cause this one does not know, a
    field it never heard of, and a concurrency it counts as usual."""
    body = record(request_id, started_at, concurrency_peak=8).to_compact_dict()
    body.update(stop_reason="speculation_rejected", cause="speculation_rejected", outcome="cut",
                new_field={"nested": [1, 2]}, length_cause="some_new_cause")
    return body


def insert(path: Path, rows: list[tuple[str, float, bytes]]) -> None:
    """Rows as another writer put them, bodies as they are."""
    with sqlite3.connect(path) as connection:
        connection.executemany(
            "INSERT INTO records (instance, request_id, started_at, model, route, stop_reason, cause, outcome, "
            "concurrency, body) VALUES ('a:8080', ?, ?, 'm', '/v1/chat/completions', 'x', 'x', 'cut', '8', ?)", rows)


def test_a_stored_record_is_read_as_far_as_this_version_can() -> None:
    found = record_from_stored(newer("n1", 1.0))
    assert found is not None and found.stop_reason == "unknown" and found.length_cause == "unknown"
    assert found.cause == "unknown" and found.outcome == "unknown"
    assert "stop_reason=speculation_rejected" in (found.values_ignored or "")
    for broken in ([1, 2, 3], "text", {"request_id": "x"}, {**newer("n2", 1.0), "started_at": "yesterday"},
                   {**newer("n3", 1.0), "request_id": 7}):
        assert record_from_stored(broken) is None
    odd = record_from_stored({**newer("n4", 1.0), "output_tokens": "many", "observer_errors": "one"})
    assert odd is not None and odd.output_tokens is None and odd.observer_errors == []


async def test_rows_of_another_version_serve_the_api_diagnose_and_the_cli(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    now = time.time()
    history = History(str(path), max_age_s=0, max_bytes=0)
    assert history.open()
    for n in range(12):
        history.on_response(record(f"ours{n}", now - 100 + n, concurrency_peak=1 if n < 6 else 8,
                                   stop_reason="eos" if n < 6 else "length", length_cause="server_limit",
                                   requested_max_tokens=64))
    await asyncio.to_thread(history.close)
    insert(path, [(f"newer{n}", now - 50 + n, orjson.dumps(newer(f"newer{n}", now - 50 + n))) for n in range(4)]
           + [("array", now - 40, b"[1, 2, 3]"), ("garbage", now - 39, b"{not json"),
              ("nostart", now - 38, orjson.dumps({"request_id": "nostart", "method": "POST"}))])

    proxy = await start_proxy(proxy_config("http://127.0.0.1:9", history_path=str(path)))
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{proxy.admin_url}/api/requests?limit=100") as response:
                assert response.status == 200
                page = await response.json()
            assert page["count"] == 16 and page["skipped"] == 3
            assert {r["stop_reason"] for r in page["records"] if r["request_id"].startswith("newer")} == {"unknown"}
            async with session.get(f"{proxy.admin_url}/api/requests/newer1") as response:
                assert response.status == 200 and (await response.json())["cause"] == "unknown"
            async with session.get(f"{proxy.admin_url}/api/requests/array") as response:
                assert response.status == 404
            async with session.get(f"{proxy.admin_url}/api/diagnose?min_per_level=2") as response:
                assert response.status == 200
                verdict = await response.json()
            assert verdict["skipped"] == 3 and verdict["records"] == 16
    finally:
        await proxy.close()
    done = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "proxy", "diagnose", "--history", str(path), "--since", "1h", "--min-per-level", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "16 records since" in done.stdout
    assert "3 rows of the history hold no record this version can read" in done.stderr
