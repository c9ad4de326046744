"""The admin page at `/`, in the real headless Chromium against a proxy with traffic: records shown,
a filter applied, one record in full, the live verdict; and the page behind the admin token."""

from __future__ import annotations

import asyncio
import subprocess
import tempfile

import aiohttp
import orjson
import pytest

from proxy.serve.app import RunningProxy
from tests.support.postgres import PASSWORD, PostgresServer
from tests.support.proxies import ProxyFactory
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.sweep.test_report_browser import CHROMIUM, FLAGS

CHAT = {"model": "m", "stream": True, "max_tokens": 64, "messages": [{"role": "user", "content": "x"}]}
LENGTH = Script(chunks=[b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n',
                        b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
                        b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n'
                        b"data: [DONE]\n\n"], delay=0.05)
EOS = Script(chunks=[b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n',
                     b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n', b"data: [DONE]\n\n"],
             delay=0.05)


async def traffic(upstream: ScriptedUpstream, proxy: RunningProxy) -> None:
    """Six answers alone, all complete; eight at once, cut below their budget: a load effect."""
    async with aiohttp.ClientSession() as client:
        async def one(request_id: str) -> None:
            async with client.post(proxy.proxy_url + "/v1/chat/completions", json=CHAT,
                                   headers={"X-Request-Id": request_id}) as response:
                await response.read()

        for n in range(6):
            upstream.push(EOS)
            await one(f"alone-{n}")
        upstream.push(*[LENGTH] * 8)
        await asyncio.gather(*(one(f"busy-{n}") for n in range(8)))


def dom(url: str) -> str:
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory() as profile:
        result = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
                                capture_output=True, text=True, timeout=90, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
async def test_the_page_shows_live_records_a_filter_and_the_verdict_in_a_real_browser(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(upstream.url)
    await traffic(upstream, proxy)
    page = await asyncio.to_thread(dom, proxy.admin_url + "/")
    assert page.count('data-id="') == 14 and 'data-id="busy-3"' in page and 'data-id="alone-0"' in page
    assert "14 records (memory)" in page
    assert "Verdict: serving defect" in page and 'class="completion-chart"' in page
    assert ">c=1</text>" in page and ">100%</text>" in page and ">0%</text>" in page
    assert "llm-diag-proxy sweep --target" in page  # the controlled sweep to be sure
    filtered = await asyncio.to_thread(dom, proxy.admin_url + "/#stop_reason=length")
    assert filtered.count('data-id="') == 8 and 'data-id="alone-0"' not in filtered
    assert '<option value="length" selected' in filtered or 'length</option>' in filtered
    one = await asyncio.to_thread(dom, proxy.admin_url + "/#record=busy-2")
    assert '"request_id": "busy-2"' in one and '"cause": "server_limit"' in one  # the record in full


async def test_the_live_verdict_api_and_one_record_in_full(upstream: ScriptedUpstream,
                                                           make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(upstream.url)
    await traffic(upstream, proxy)
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.admin_url + "/api/diagnose?since=600") as response:
            found = orjson.loads(await response.read())
        (group,) = found["groups"]
        assert group["verdict"]["kind"] == "serving_defect" and [lvl["level"] for lvl in group["levels"]] == [1, 8]
        assert "observational" in found["observational"]
        async with client.get(proxy.admin_url + "/api/diagnose?since=nope") as response:
            assert response.status == 400
        async with client.get(proxy.admin_url + "/") as response:
            text = await response.text()
            assert response.status == 200 and "Recent records" in text and "<script src" not in text


async def test_the_page_is_behind_the_admin_token(upstream: ScriptedUpstream, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(upstream.url, admin_token="s3cret-token")
    # unsafe: aiohttp's jar, unlike a browser's, keeps no cookie of an IP address otherwise
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as client:
        async with client.get(proxy.admin_url + "/") as response:
            assert response.status == 401 and "s3cret" not in await response.text()
        async with client.get(proxy.admin_url + "/?token=wrong") as response:
            assert response.status == 401
        async with client.get(proxy.admin_url + "/?token=s3cret-token", allow_redirects=False) as response:
            assert response.status == 302 and response.headers["Location"] == "/"
            cookie = response.cookies["llm_diag_admin"]
            assert cookie.value != "s3cret-token" and cookie["httponly"] and cookie["samesite"] == "Strict"
        async with client.get(proxy.admin_url + "/") as response:  # the session's cookie jar has it now
            assert response.status == 200
        async with client.get(proxy.admin_url + "/api/requests") as response:
            assert response.status == 200
    async with aiohttp.ClientSession() as stranger, stranger.get(proxy.admin_url + "/api/diagnose") as response:
        assert response.status == 401


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
async def test_a_fleets_page_shows_every_instance_and_filters_by_one(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory, postgres: PostgresServer) -> None:
    first = await make_proxy(upstream.url, history_path=postgres.url(), instance="gpu-a:8080")
    second = await make_proxy(upstream.url, history_path=postgres.url(), instance="gpu-b:8080")
    for proxy, count in ((first, 2), (second, 3)):
        async with aiohttp.ClientSession() as client:
            for n in range(count):
                upstream.push(EOS)
                async with client.post(proxy.proxy_url + "/v1/chat/completions", json=CHAT,
                                       headers={"X-Request-Id": f"{proxy.config.instance}-{n}"}) as response:
                    await response.read()
    # The other instance's records are in the shared history once it wrote them: its own page read
    # would settle them first, the first instance's cannot (they wait for their batch, then its writer).
    history = second.history
    assert history is not None and await asyncio.to_thread(history.settle)
    page = await asyncio.to_thread(dom, first.admin_url + "/")
    assert page.count('data-id="') == 5 and "5 records (history)" in page and ">gpu-b:8080</td>" in page
    only = await asyncio.to_thread(dom, first.admin_url + "/#instance=gpu-b%3A8080")
    assert only.count('data-id="') == 3 and 'data-id="gpu-a:8080-0"' not in only
    assert PASSWORD not in page + only
