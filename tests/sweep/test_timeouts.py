"""A timeout in the path: cut answers whose durations repeat are named by duration and side, the
proxy's own deadline as such, and neither scattered cuts nor cancels at once are called a timer."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from pathlib import Path

import aiohttp
import orjson

from proxy.record import ResponseRecord
from proxy.sweep.stats import summarize
from proxy.sweep.timeouts import repeated_cuts
from proxy.sweep.verdict import decide
from tests.serve.test_admin_page import dom
from tests.support.cutting_relay import CuttingRelay
from tests.support.proxies import ProxyFactory
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.sweep_samples import level, sample
from tests.support.wire import openai_stream
from tests.sweep.test_report_browser import CHROMIUM

ROOT = Path(__file__).resolve().parents[2]


def cut(duration: float, stop: str = "client_disconnect", **fields: object) -> ResponseRecord:
    return ResponseRecord(request_id="r", method="POST", path="/v1/chat/completions", route="/v1/chat/completions",
                          dialect="openai", started_at=0.0, stop_reason=stop, duration_s=duration,  # type: ignore[arg-type]
                          **fields)  # type: ignore[arg-type]


def test_cuts_at_one_duration_are_named_with_their_side_and_the_usual_suspect() -> None:
    rng = random.Random(1)
    records = [cut(60.0 + rng.uniform(-0.3, 0.3)) for _ in range(41)]
    records += [cut(rng.uniform(1, 200)) for _ in range(10)]  # other disconnects, scattered
    records += [cut(rng.uniform(0, 0.9)) for _ in range(20)]  # clients cancelling at once: no timer
    records += [cut(5.0, "eos") for _ in range(30)]  # complete answers are no cuts
    (found,) = repeated_cuts(records)
    assert found.side == "client" and found.count == 41 and abs(found.duration_s - 60.0) < 0.3
    text = found.text()
    assert text.startswith("cut at 60.0 s, 41 times (client_disconnect x41") and "between the clients" in text
    assert "nginx's proxy_read_timeout" in text


def test_the_upstream_side_and_the_proxys_own_deadline_are_told_apart() -> None:
    records = [cut(180.0 + i * 0.1, "upstream_disconnect") for i in range(5)]
    records += [cut(180.0, "upstream_error", upstream_error="timeout") for _ in range(2)]
    records += [cut(30.0 + i * 0.01, "deadline", deadline_hit="total") for i in range(4)]
    found = {c.side: c for c in repeated_cuts(records)}
    assert found["upstream"].count == 7 and "between the proxy and the server" in found["upstream"].text()
    assert "a timer of about 180 s" in found["upstream"].text()
    assert found["proxy"].count == 4 and "the proxy's own limit" in found["proxy"].text()
    assert "--deadline" in found["proxy"].text()


def test_scattered_cuts_name_no_timer() -> None:
    rng = random.Random(7)
    records = [cut(rng.uniform(1, 300), rng.choice(["client_disconnect", "upstream_disconnect"])) for _ in range(60)]
    assert repeated_cuts(records) == []
    assert repeated_cuts([cut(60.0), cut(60.1)]) == []  # two are not a pattern


def test_the_sweeps_verdict_names_a_timeout_beside_its_cause() -> None:
    groups = {1: level(1, 4), 4: [*level(4, 2), *[sample(4, 2 + i, stop="client_disconnect", duration=12.0 + i * 0.01)
                                                  for i in range(6)]]}
    verdict = decide(summarize([s for g in groups.values() for s in g]), groups, client_timeout_s=12.0)
    assert verdict.kind == "policy" and verdict.onset_level == 4
    assert any(line.startswith("TIMEOUT IN THE PATH: cut at 12.0 s, 6 times (client_disconnect")
               for line in verdict.evidence)


async def test_a_relay_that_cuts_in_front_of_the_proxy_and_one_behind_it_are_named_by_side(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory, tmp_path: Path) -> None:
    upstream.default = Script(chunks=openai_stream(200), delay=0.02)  # about 4 s of tokens: longer than the cuts
    behind = CuttingRelay(int(upstream.url.rsplit(":", 1)[1]), 1.5)
    await behind.start()
    proxies = []
    try:
        for name, target in (("front", upstream.url), ("behind", behind.url)):
            proxies.append(await make_proxy(target, history_path=str(tmp_path / f"{name}.sqlite3"), instance=name))
        front = CuttingRelay(int(proxies[0].proxy_url.rsplit(":", 1)[1]), 2.5)
        await front.start()
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as client:
            async def one(url: str) -> None:
                try:
                    async with client.post(url + "/v1/chat/completions", json=body) as response:
                        await response.read()
                except aiohttp.ClientError:
                    pass  # the cut, as the client meets it

            await asyncio.gather(*(one(front.url) for _ in range(4)), *(one(proxies[1].proxy_url) for _ in range(4)))
        await front.close()
        for proxy in proxies:
            assert proxy.history is not None
            for _ in range(100):
                if len(proxy.store) >= 4:
                    break
                await asyncio.sleep(0.05)
            assert await asyncio.to_thread(proxy.history.settle, 5.0)
        async with aiohttp.ClientSession() as client, client.get(
                proxies[0].admin_url + "/api/diagnose?min_per_level=1") as response:
            api = orjson.loads(await response.read())
        if CHROMIUM is not None:  # the page says it too, in the real browser
            page = await asyncio.to_thread(dom, proxies[0].admin_url + "/")
            assert "A timeout in the path (client side)" in page and "cut at 2.5 s, 4 times" in page
    finally:
        await behind.close()
    assert [(t["side"], t["count"]) for t in api["timeouts"]] == [("client", 4)]
    results = {}
    for name in ("front", "behind"):
        path = str(tmp_path / f"{name}.sqlite3")
        done = subprocess.run([sys.executable, "-m", "proxy", "diagnose", "--history", path], cwd=ROOT,
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        results[name] = [line for line in done.stdout.splitlines() if line.startswith("TIMEOUT IN THE PATH")]
    (front_line,) = results["front"]
    assert front_line.startswith("TIMEOUT IN THE PATH: cut at 2.5 s, 4 times (client_disconnect x4")
    assert "between the clients and the proxy" in front_line
    (behind_line,) = results["behind"]
    assert behind_line.startswith("TIMEOUT IN THE PATH: cut at 1.5 s, 4 times (upstream_disconnect x4")
    assert "between the proxy and the server" in behind_line

