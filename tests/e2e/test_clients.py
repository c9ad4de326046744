"""Whose answers are cut: two clients with different API keys through a real proxy process; each
record names its client by a keyed hash, the page, the API, the history, the metrics and diagnose
attribute the cut answers, and no key appears in any output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import aiohttp
import orjson

from proxy.record import ResponseRecord
from proxy.sweep.whose import whose
from tests.support.proxies import start_served
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.wire import openai_stream

ROOT = Path(__file__).resolve().parents[2]
ALICE, BOB = "sk-alice-Kq81-secret", "sk-bob-Zr55-secret"
CHAT = {"model": "m", "stream": True, "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}


async def test_two_clients_are_attributed_and_no_key_appears_anywhere(
        upstream: ScriptedUpstream, tmp_path: Path, client: aiohttp.ClientSession) -> None:
    history = tmp_path / "history.sqlite3"
    served = await start_served(upstream.url, tmp_path, "--history", str(history), "--client-metrics", "5",
                                "--client-secret-file", str(_secret(tmp_path)))
    outputs: list[str] = []
    try:
        upstream.default = Script(chunks=openai_stream(5))
        for n in range(4):
            await _send(client, served.proxy_url, ALICE, f"alice-{n}")
        upstream.default = Script(chunks=openai_stream(50)[:10], end="reset")  # cut mid-answer
        for n in range(4):
            await _send(client, served.proxy_url, BOB, f"bob-{n}")
        async with client.get(served.admin_url + "/api/requests?limit=100") as response:
            page = await response.read()
        records = orjson.loads(page)["records"]
        names = {r["request_id"].split("-")[0]: r["client"] for r in records}
        assert names["alice"].startswith("key:") and names["bob"].startswith("key:") and names["alice"] != names["bob"]
        async with client.get(served.admin_url + f"/api/requests?client={names['bob']}") as response:
            only = orjson.loads(await response.read())["records"]
        assert sorted(r["request_id"] for r in only) == [f"bob-{n}" for n in range(4)]
        async with client.get(served.admin_url + "/metrics") as response:
            metrics = await response.text()
        assert f'llm_proxy_client_requests_total{{client="{names["bob"]}",outcome="cut"}} 4.0' in metrics
        async with client.get(served.admin_url + "/api/diagnose?min_per_level=1") as response:
            verdict = orjson.loads(await response.read())
        assert verdict["whose"][0].startswith(f"WHOSE ANSWERS ARE CUT: {names['bob']} 4 of 4 (100%)")
        outputs += [page.decode(), metrics, orjson.dumps(verdict).decode()]
    finally:
        served.stop()
    done = subprocess.run([sys.executable, "-m", "proxy", "diagnose", "--history", str(history), "--by", "client",
                           "--min-per-level", "1"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert f"WHOSE ANSWERS ARE CUT: {names['bob']} 4 of 4 (100%)" in done.stdout
    outputs += [done.stdout, done.stderr, served.log.read_text(), history.read_bytes().decode("latin-1")]
    for text in outputs:
        for key in (ALICE, BOB, "Kq81", "Zr55"):
            assert key not in text


def _secret(tmp_path: Path) -> Path:
    path = tmp_path / "client-secret"
    path.write_bytes(b"a-fleet-wide-secret-of-32-bytes!")
    return path


async def _send(client: aiohttp.ClientSession, url: str, key: str, request_id: str) -> None:
    try:
        async with client.post(url + "/v1/chat/completions", json=CHAT,
                               headers={"Authorization": f"Bearer {key}", "X-Request-Id": request_id}) as response:
            await response.read()
    except aiohttp.ClientPayloadError:
        pass  # the cut, as the client meets it


def _record(client: str, start: float, duration: float, outcome_stop: str = "eos") -> ResponseRecord:
    return ResponseRecord(request_id=f"{client}-{start}", method="POST", path="/v1/chat/completions",
                          route="/v1/chat/completions", dialect="openai", started_at=start, duration_s=duration,
                          stop_reason=outcome_stop, client=client)  # type: ignore[arg-type]


def test_the_clients_in_flight_at_the_cuts_are_counted_by_overlap() -> None:
    records = [_record("key:batch", float(t), 10.0) for t in range(0, 30, 2)]  # a client with long requests
    records += [_record("key:chat", 12.0 + t * 0.5, 1.0, "upstream_disconnect") for t in range(4)]  # cut
    records += [_record("key:chat", 100.0, 1.0)]  # alone, later: overlaps no cut
    found = whose(records)
    assert found is not None
    assert found["cut"] == [{"client": "key:chat", "cut": 4, "sent": 5}]
    assert found["in_flight_at_cuts"][0]["client"] == "key:batch" and found["in_flight_at_cuts"][0]["share"] > 0.7
    assert whose([_record("", 0.0, 1.0)]) is None  # no record names a client: nothing said
