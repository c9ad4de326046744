"""The admin listener against what an outside attack tried: numbers too large for an integer, cookies of
any bytes, a web page that rebinds its name to the proxy, session cookies that never expire, and a
history database anyone on the machine could read."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import aiohttp
import pytest

from proxy.config import ConfigError, parse_host_names
from proxy.serve.admin import Sessions, allowed_host, bounded_int
from tests.support.proxies import ProxyFactory, record_for
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.wire import openai_stream


async def status_of(url: str, **headers: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as response:
        await response.read()
        return response.status


# --- query values and cookies: a 4xx, never a 500 --------------------------------------------------------

@pytest.mark.parametrize("query", [
    "cursor=9223372036854775808", "cursor=-1", "cursor=1e3", f"limit={'9' * 5000}", "limit=0", "limit=١٢",
    "since=1e400", "until=nan", "since=inf", f"since={'9' * 400}s", "cursor=%F0%9F%98%80",
])
async def test_out_of_range_query_values_are_a_400(upstream: ScriptedUpstream, make_proxy: ProxyFactory,
                                                    query: str) -> None:
    proxy = await make_proxy(upstream.url)
    assert await status_of(f"{proxy.admin_url}/api/requests?{query}") == 400


@pytest.mark.parametrize("query", [f"since={'9' * 5000}", "min_per_level=" + "9" * 5000, "since=nan"])
async def test_out_of_range_diagnose_values_are_a_400(upstream: ScriptedUpstream, make_proxy: ProxyFactory,
                                                       query: str) -> None:
    proxy = await make_proxy(upstream.url)
    assert await status_of(f"{proxy.admin_url}/api/diagnose?{query}") == 400


def test_bounded_integers_count_digits_before_converting() -> None:
    assert bounded_int("1000", 1, 1000) == 1000 and bounded_int("1001", 1, 1000) is None
    assert bounded_int("9" * 5000, 0, 10) is None and bounded_int("١٢", 0, 100) is None
    assert bounded_int("", 0, 1) is None


@pytest.mark.parametrize("cookie", ["llm_diag_admin=caf\u00e9", "llm_diag_admin=\udcff", "llm_diag_admin=1.2.3",
                                    "llm_diag_admin=99999999999999999999999.x", "llm_diag_admin=" + "a" * 4000])
async def test_any_cookie_is_a_401_without_the_token(upstream: ScriptedUpstream, make_proxy: ProxyFactory,
                                                     cookie: str) -> None:
    proxy = await make_proxy(upstream.url, admin_token="t0ken")
    reader, writer = await asyncio.open_connection(*proxy.admin_url.removeprefix("http://").split(":"))
    writer.write(b"GET /api/requests HTTP/1.1\r\nHost: 127.0.0.1\r\nCookie: " +
                 cookie.encode("utf-8", "surrogateescape") + b"\r\nConnection: close\r\n\r\n")
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert answer.split(b"\r\n", 1)[0] in (b"HTTP/1.1 401 Unauthorized", b"HTTP/1.1 400 Bad Request")


# --- Host: no DNS rebinding ------------------------------------------------------------------------------

@pytest.mark.parametrize(("host", "allowed"), [
    ("127.0.0.1:9464", True), ("[::1]:9464", True), ("localhost:9464", True), ("app.localhost", True),
    ("10.1.2.3", True), ("evil.example:9464", False), ("127.0.0.1.nip.io", False), ("", False),
])
def test_which_hosts_the_admin_page_answers(host: str, allowed: bool) -> None:
    assert allowed_host(host, frozenset()) is allowed


def test_named_hosts_and_a_wildcard_can_be_allowed() -> None:
    assert allowed_host("proxy.internal:9464", parse_host_names("proxy.internal, other"))
    assert allowed_host("anything.example", parse_host_names("*"))
    with pytest.raises(ConfigError):
        parse_host_names("bad host!")


async def test_a_rebound_name_finds_neither_the_records_nor_the_page(upstream: ScriptedUpstream,
                                                                    make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(upstream.url)
    for path in ("/api/requests", "/", "/api/diagnose"):
        assert await status_of(proxy.admin_url + path, Host="attacker.example:9464") == 403
        assert await status_of(proxy.admin_url + path) == 200
    for path in ("/metrics", "/healthz", "/readyz"):  # scrapers and probes address the admin by any name
        assert await status_of(proxy.admin_url + path, Host="proxy:9464") == 200
    named = await make_proxy(upstream.url, admin_allowed_hosts=frozenset({"proxy.internal"}))
    assert await status_of(named.admin_url + "/api/requests", Host="proxy.internal:9464") == 200


async def test_the_admin_names_no_aiohttp_version(upstream: ScriptedUpstream, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(upstream.url)
    async with aiohttp.ClientSession() as session, session.get(proxy.admin_url + "/healthz") as response:
        assert response.headers.get("Server") == "llm-diag-proxy"


# --- session cookies expire, and a restart revokes them ---------------------------------------------------

def test_a_session_expires_and_another_process_or_token_refuses_it() -> None:
    now = [1000.0]
    sessions = Sessions("t0ken", ttl_s=60, clock=lambda: now[0])
    cookie = sessions.issue()
    assert sessions.valid(cookie) and "t0ken" not in cookie
    now[0] += 61
    assert not sessions.valid(cookie)
    now[0] = 1000.0
    assert not Sessions("t0ken", ttl_s=60, clock=lambda: now[0]).valid(cookie)  # a restart: a new key
    forged = cookie.split(".")[0] + "0" + "." + cookie.split(".")[1]  # a later expiry, the same signature
    assert not sessions.valid(forged)


async def test_the_cookie_says_when_it_expires(upstream: ScriptedUpstream, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(upstream.url, admin_token="t0ken")
    async with aiohttp.ClientSession() as session, session.get(proxy.admin_url + "/?token=t0ken",
                                                               allow_redirects=False) as response:
        cookie = response.cookies["llm_diag_admin"]
        assert response.status == 302 and cookie["max-age"] == str(12 * 3600)


# --- the history is its owner's alone ----------------------------------------------------------------------

async def test_the_history_and_its_wal_and_shm_are_created_private(upstream: ScriptedUpstream,
                                                                   make_proxy: ProxyFactory, tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        path = tmp_path / "state" / "history.sqlite3"
        proxy = await make_proxy(upstream.url, history_path=str(path))
        upstream.push(Script(openai_stream(2)))
        async with aiohttp.ClientSession() as session, session.post(
                proxy.proxy_url + "/v1/chat/completions", headers={"X-Request-Id": "priv"},
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}) as response:
            await response.read()
        await record_for(proxy, "priv")
        assert proxy.history is not None
        while proxy.history.written < 1:
            await asyncio.sleep(0.02)
        for name in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
            assert stat.S_IMODE(name.stat().st_mode) == 0o600, name
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    finally:
        os.umask(old)


def test_a_history_left_world_readable_by_an_older_version_is_closed_down(tmp_path: Path) -> None:
    from proxy.observers.history.sqlite import make_private

    path = tmp_path / "history.sqlite3"
    for name in (path, Path(f"{path}-wal")):
        name.write_bytes(b"")
        name.chmod(0o644)
    make_private(str(path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(Path(f"{path}-wal").stat().st_mode) == 0o600
