"""The attacks an outside test found, each pinned: none may come back.

Credentials in the upstream URL, credentials echoed by the HTTP parser, a POST sent twice (see
test_upstream_pool.py), a listen backlog too short for a burst, a shutdown that outlived every
grace period, unbounded body memory, `Expect: 100-continue`, an admin scrape that stalls live
streams, headers the proxy changed, odd admin authorization, slow-header clients, half-closed
clients, text that is not UTF-8.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.config import ConfigError, parse_upstream_url
from proxy.serve.app import RunningProxy
from tests.support.proxies import ProxyFactory, record_for, start_served
from tests.support.raw_http import exchange
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.wire import JSON_HEADERS, openai_completion, openai_stream

PASSWORD = "hunter2-upstream-password"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 16}


def with_credentials(url: str) -> str:
    return url.replace("http://", f"http://proxyuser:{PASSWORD}@")


# --- 1. credentials in the upstream URL -----------------------------------------------------------

async def test_upstream_credentials_are_sent_as_a_header_and_the_clients_own_wins(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory, client: aiohttp.ClientSession) -> None:
    proxy = await make_proxy(with_credentials(upstream.url))
    assert PASSWORD not in proxy.config.upstream and PASSWORD not in repr(proxy.config)
    upstream.push(Script(openai_stream(2)), Script(openai_stream(2)))
    async with client.post(proxy.proxy_url + "/v1/chat/completions", json=CHAT,
                           headers={"Authorization": "Bearer client-key"}) as response:
        assert response.status == 200
        await response.read()
    assert upstream.seen[-1].headers["Authorization"] == "Bearer client-key"
    async with client.post(proxy.proxy_url + "/v1/chat/completions", json=CHAT) as response:
        assert response.status == 200
        await response.read()
    assert upstream.seen[-1].headers["Authorization"] == "Basic cHJveHl1c2VyOmh1bnRlcjItdXBzdHJlYW0tcGFzc3dvcmQ="


async def test_upstream_credentials_never_appear_in_logs_readyz_or_a_502() -> None:
    down = with_credentials("http://127.0.0.1:9")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--upstream", down, "--listen", "127.0.0.1:0",
        "--admin-listen", "127.0.0.1:0", "--log-format", "json", "--log-level", "debug",
        "--gpu-poll-interval", "0", "--upstream-metrics", "auto", "--upstream-metrics-interval", "0.2",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert process.stdout is not None
    lines: list[bytes] = []
    try:
        async with asyncio.timeout(20):
            while not lines or b'"listening"' not in lines[-1]:
                line = await process.stdout.readline()
                assert line, "serve exited before listening"
                lines.append(line)
        listening = orjson.loads(lines[-1])
        async with aiohttp.ClientSession() as session:
            async with session.post(listening["proxy"] + "/v1/chat/completions", json=CHAT) as response:
                body = await response.text()
                assert response.status == 502
            async with session.get(listening["admin"] + "/readyz") as response:
                ready = await response.text()
            await asyncio.sleep(0.5)  # telemetry's failing polls log their line too
    finally:
        process.send_signal(signal.SIGTERM)
        stdout, stderr = await asyncio.wait_for(process.communicate(), 30)
    text = b"".join(lines).decode() + stdout.decode() + stderr.decode()
    for name, shown in (("502 body", body), ("readyz", ready), ("log", text)):
        assert PASSWORD not in shown, name
    assert "127.0.0.1:9" in body and "127.0.0.1:9" in ready  # the upstream is still named, without its password


def test_a_bad_upstream_url_error_never_shows_its_password() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_upstream_url(f"ftp://user:{PASSWORD}@host:1")
    assert PASSWORD not in str(raised.value) and "user:***@host" in str(raised.value)
    result = subprocess.run([sys.executable, "-m", "proxy", "serve", "--upstream", f"http://u:{PASSWORD}@h:99999"],
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2 and PASSWORD not in result.stderr and "u:***@h" in result.stderr


# --- 2. requests the HTTP parser refuses ----------------------------------------------------------

@pytest.mark.parametrize(("header", "reasons"), [
    (b"Cookie: session=" + b"c" * 9000 + b"SECRETCOOKIE", {"line_too_long"}),
    # aiohttp's C parser calls it a bad message, its pure-Python one (AIOHTTP_NO_EXTENSIONS=1) a bad header
    (b"Authorization: Bearer SECRET\x01TOKEN", {"bad_message", "bad_header"}),
], ids=["a 9 KB cookie", "a control byte in a token"])
async def test_a_refused_header_is_never_echoed_or_logged(upstream: ScriptedUpstream, make_proxy: ProxyFactory,
                                                          caplog: pytest.LogCaptureFixture, header: bytes,
                                                          reasons: set[str]) -> None:
    proxy = await make_proxy(upstream.url)
    caplog.set_level(logging.DEBUG, logger="aiohttp")
    answer = await exchange(proxy.proxy_url, b"GET /v1/models HTTP/1.1\r\nHost: p\r\n" + header + b"\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    # In the client's version, with the close said: aiohttp answers through a stand-in request of version 1.0.
    assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n") and b"\r\nConnection: close" in head
    assert b"application/json" in head
    assert b"\r\nServer:" not in head and b"aiohttp" not in answer  # (aiohttp's own names its version)
    assert orjson.loads(body)["error"]["type"] == "bad_request"
    assert b"SECRET" not in answer
    logged = [r.getMessage() for r in caplog.records]
    assert logged and not any("SECRET" in line for line in logged) and all("\n" not in line for line in logged)
    assert all(r.exc_info is None for r in caplog.records)
    assert upstream.seen == []
    counted = {reason: proxy.metrics.registry.get_sample_value("llm_proxy_invalid_requests_total", {"reason": reason})
               for reason in reasons}
    assert sorted(value for value in counted.values() if value) == [1]  # counted once, under one bounded name


async def test_the_admin_listener_refuses_a_request_it_cannot_read_without_naming_aiohttp(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(upstream.url)
    answer = await exchange(proxy.admin_url, b"GET /healthz HTTP/1.1\r\nHost: p\r\nBad Header\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n") and b"\r\nConnection: close" in head
    assert orjson.loads(body)["error"]["type"] == "bad_request"
    assert b"\r\nServer:" not in head and b"aiohttp" not in answer


# --- 4. the listen backlog -----------------------------------------------------------------------

async def test_the_proxy_listens_with_the_backlog_it_was_given(upstream: ScriptedUpstream,
                                                               make_proxy: ProxyFactory) -> None:
    if shutil.which("ss") is None:
        pytest.skip("`ss` (iproute2) is not installed: the listen queue cannot be read")
    proxy = await make_proxy(upstream.url, backlog=1500)
    port = proxy.proxy_url.rsplit(":", 1)[1]
    listing = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    somaxconn = int(open("/proc/sys/net/core/somaxconn").read())  # noqa: SIM115 - one read of a proc file
    assert int(listing.split()[2]) == min(1500, somaxconn)  # Send-Q of a listening socket: its backlog


# --- 5. shutdown --------------------------------------------------------------------------------

class HangingUpstream:
    """Starts an SSE answer, sends two chunks, then never ends it."""

    def __init__(self) -> None:
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in openai_stream(2)[:2]:
            await response.write(chunk)
        await asyncio.sleep(3600)
        return response

    async def __aenter__(self) -> HangingUpstream:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def test_sigterm_refuses_new_connections_ends_open_streams_visibly_and_writes_their_records() -> None:
    async with HangingUpstream() as hanging:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "serve", "--upstream", hanging.url, "--listen", "127.0.0.1:0",
            "--admin-listen", "127.0.0.1:0", "--log-format", "json", "--gpu-poll-interval", "0",
            "--upstream-metrics", "off", "--shutdown-grace", "1",
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        assert process.stdout is not None
        async with asyncio.timeout(20):
            while b'"listening"' not in (line := await process.stdout.readline()):
                assert line, "serve exited before listening"
        proxy_url = orjson.loads(line)["proxy"]
        session = aiohttp.ClientSession()
        responses = [await session.post(proxy_url + "/v1/chat/completions", json=CHAT,
                                        headers={"X-Request-Id": f"open-{i}"}) for i in range(3)]
        for response in responses:
            assert await response.content.readany()  # the stream is open
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        host, port = proxy_url.removeprefix("http://").split(":")
        with pytest.raises(OSError):  # refused at once: the listening socket is closed
            socket.create_connection((host, int(port)), timeout=1).close()
        bodies = [await response.read() for response in responses]
        await session.close()
        stdout, _ = await asyncio.wait_for(process.communicate(), 20)
        took = time.monotonic() - started
    assert process.returncode == 0 and took < 1 + 4  # the grace, and a moment to end them
    for body in bodies:
        assert b'"type":"proxy_shutdown"' in body and b"[DONE]" not in body
    records = [orjson.loads(x) for x in (line + stdout).splitlines() if b'"event":"response"' in x]
    assert sorted(r["request_id"] for r in records) == ["open-0", "open-1", "open-2"]
    assert {r["stop_reason"] for r in records} == {"proxy_shutdown"}


async def test_shutdown_lets_streams_that_end_within_the_grace_end_on_their_own(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory, client: aiohttp.ClientSession) -> None:
    proxy = await make_proxy(upstream.url)
    upstream.push(Script(openai_stream(20), delay=0.02))
    response = await client.post(proxy.proxy_url + "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "g"})
    await response.content.readany()
    took = await proxy.shutdown(5.0)
    body = await response.read()
    assert body.endswith(b"data: [DONE]\n\n") and took < 3
    assert proxy.store.get("g") is not None and proxy.store.get("g").stop_reason == "eos"  # type: ignore[union-attr]


# --- 6. memory held for parsing --------------------------------------------------------------------

async def test_bodies_past_the_process_wide_parse_budget_pass_unread(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory, client: aiohttp.ClientSession) -> None:
    proxy = await make_proxy(upstream.url, parse_bytes_max=300_000)
    big = orjson.dumps({"model": "m", "stream": False, "messages": [{"role": "user", "content": "x" * 200_000}]})
    for _i in range(3):
        upstream.push(Script([openai_completion(3)], headers=JSON_HEADERS, first_delay=0.3))
    sent = [client.post(proxy.proxy_url + "/v1/chat/completions", data=big,
                        headers={"X-Request-Id": f"big-{i}", "Content-Type": "application/json"}) for i in range(3)]
    for response in await asyncio.gather(*sent):
        assert response.status == 200
        await response.read()
    records = [await record_for(proxy, f"big-{i}") for i in range(3)]
    unread = [r for r in records if r.request_note is not None]
    assert unread and all("bytes held for parsing" in (r.request_note or "") for r in unread)
    assert all(r.model is None for r in unread) and any(r.model == "m" for r in records)
    assert sorted(len(seen.body) for seen in upstream.seen) == [len(big)] * 3  # every body went on whole
    assert proxy.forwarder.parse_bytes.used == 0  # everything held was given back


async def test_big_bodies_of_declared_length_are_read_first_come_first_served(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory, client: aiohttp.ClientSession) -> None:
    """Five bodies at once, room for two: two are read, three pass unread. Taken piece by piece,
    all five would each hold part of the budget and all five fail."""
    body_size = 400_000
    proxy = await make_proxy(upstream.url, parse_bytes_max=2 * body_size + 1000)
    big = orjson.dumps({"model": "m", "stream": False, "messages": [{"role": "user", "content": "x" * body_size}]})
    for _i in range(5):
        upstream.push(Script([openai_completion(3)], headers=JSON_HEADERS, first_delay=0.3))
    sent = [client.post(proxy.proxy_url + "/v1/chat/completions", data=big,
                        headers={"X-Request-Id": f"fc-{i}", "Content-Type": "application/json"}) for i in range(5)]
    for response in await asyncio.gather(*sent):
        await response.read()
    records = [await record_for(proxy, f"fc-{i}") for i in range(5)]
    assert sum(r.model == "m" for r in records) == 2
    assert sum("bytes held for parsing" in (r.request_note or "") for r in records) == 3
    assert proxy.forwarder.parse_bytes.used == 0


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("size", [3 * 1024 * 1024 + 7, 40 * 1024 * 1024], ids=["read", "over-the-cap"])
async def test_a_big_body_goes_upstream_identical_and_framed_as_the_client_framed_it(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory, size: int, chunked: bool) -> None:
    """A held body is sent from its one buffer in slices, with its length; one over the cap is
    streamed on with the client's own Content-Length, or chunked when the client chunked it."""
    proxy = await make_proxy(upstream.url)
    body = orjson.dumps({"model": "m", "stream": False, "messages": [{"role": "user", "content": "y" * size}]})
    upstream.push(Script([openai_completion(3)], headers=JSON_HEADERS))

    async def pieces():  # type: ignore[no-untyped-def]
        for start in range(0, len(body), 1 << 20):
            yield body[start:start + (1 << 20)]

    async with aiohttp.ClientSession() as session, session.post(
            proxy.proxy_url + "/v1/chat/completions", data=pieces() if chunked else body,
            headers={"X-Request-Id": "big-body", "Content-Type": "application/json"}) as response:
        assert response.status == 200
        await response.read()
    seen = upstream.seen[-1]
    assert seen.body == body
    record = await record_for(proxy, "big-body")
    if size < proxy.config.request_body_cap_bytes:
        assert record.model == "m" and record.request_note is None
        assert seen.headers.get("Content-Length") == str(len(body))
    else:
        assert record.model is None and "parse cap" in (record.request_note or "")
        if chunked:
            assert seen.headers.get("Transfer-Encoding") == "chunked" and "Content-Length" not in seen.headers
        else:
            assert seen.headers.get("Content-Length") == str(len(body))
            assert "Transfer-Encoding" not in seen.headers
    assert proxy.forwarder.parse_bytes.used == 0


async def test_a_json_answer_declared_over_the_cap_is_never_held(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory, client: aiohttp.ClientSession) -> None:
    proxy = await make_proxy(upstream.url, response_body_cap_bytes=100_000)
    answer = openai_completion(3)[:-1] + b', "padding": "' + b"p" * 300_000 + b'"}'
    upstream.push(Script([answer[:150_000], answer[150_000:]], headers=JSON_HEADERS, content_length=True,
                         delay=0.2))
    seen_used: list[int] = []

    async def watch() -> None:
        while True:
            seen_used.append(proxy.forwarder.parse_bytes.used)
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    async with client.post(proxy.proxy_url + "/v1/chat/completions", json={"model": "m"},
                           headers={"X-Request-Id": "too-big"}) as response:
        assert await response.read() == answer
    watcher.cancel()
    record = await record_for(proxy, "too-big")
    assert record.parse_error and "parse cap" in (record.parse_error_detail or "")
    assert max(seen_used) < 100  # the request body only: judged on its Content-Length, no byte of the answer held


# --- 7. Expect: 100-continue ---------------------------------------------------------------------

async def test_a_client_that_expects_100_continue_gets_its_answer(upstream: ScriptedUpstream,
                                                                   proxy: RunningProxy) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    upstream.push(Script([openai_completion(3)], headers=JSON_HEADERS))
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "y" * 4000}]}).decode()
    process = await asyncio.create_subprocess_exec(
        "curl", "-sS", "-m", "10", "-H", "Content-Type: application/json", "-H", "Expect: 100-continue",
        "--data-binary", body, proxy.proxy_url + "/v1/chat/completions",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = await process.communicate()
    assert process.returncode == 0, stderr
    assert orjson.loads(stdout)["usage"]["completion_tokens"] == 3
    assert "expect" not in {name.lower() for name in upstream.seen[-1].headers}  # answered here, not sent on


async def expecting_continue(proxy: RunningProxy, version: bytes, body: bytes, *, with_head: bytes = b"",
                             wait_s: float = 1.0) -> tuple[bytes, bytes]:
    """A raw client that says `Expect: 100-continue` and sends `with_head` with its head: what came
    before it sent the rest of its body (waiting up to `wait_s`, as curl waits a second), and the
    answer after."""
    host, port = proxy.proxy_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /v1/chat/completions HTTP/" + version + b"\r\nHost: p\r\nContent-Type: application/json\r\n"
                     b"Expect: 100-continue\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), with_head))
        await writer.drain()
        before = b""
        with contextlib.suppress(TimeoutError):
            before = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), wait_s)
        writer.write(body[len(with_head):])
        await writer.drain()
        return before, await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def test_a_100_continue_comes_at_once_and_the_body_goes_upstream_without_the_expectation(
        upstream: ScriptedUpstream, proxy: RunningProxy) -> None:
    upstream.push(Script([openai_completion(3)], headers=JSON_HEADERS))
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "y" * 4000}]})
    before, answer = await expecting_continue(proxy, b"1.1", body, wait_s=5.0)  # (it comes in milliseconds)
    assert before == b"HTTP/1.1 100 Continue\r\n\r\n", before
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and b"100 Continue" not in answer
    assert upstream.seen[-1].body == body
    assert "expect" not in {name.lower() for name in upstream.seen[-1].headers}


async def test_no_100_continue_to_an_http_1_0_client_or_once_the_body_has_begun(
        upstream: ScriptedUpstream, proxy: RunningProxy) -> None:
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]})
    for version, with_head in ((b"1.0", b""), (b"1.1", body[:10])):
        upstream.push(Script([openai_completion(3)], headers=JSON_HEADERS))
        before, answer = await expecting_continue(proxy, version, body, with_head=with_head)
        assert before == b"" and b"100 Continue" not in answer
        assert answer.split(b"\r\n", 1)[0] in (b"HTTP/1.1 200 OK", b"HTTP/1.0 200 OK")
        assert upstream.seen[-1].body == body


# --- 8. the admin API, in pages ------------------------------------------------------------------

async def test_records_page_by_cursor_and_time_without_gaps_or_repeats(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory, client: aiohttp.ClientSession) -> None:
    proxy = await make_proxy(upstream.url)
    for i in range(25):
        async with client.get(proxy.proxy_url + "/v1/models", headers={"X-Request-Id": f"p{i:02d}"}) as r:
            await r.read()
    await record_for(proxy, "p24")
    seen: list[str] = []
    cursor = None
    while True:
        url = proxy.admin_url + "/api/requests?limit=10" + (f"&cursor={cursor}" if cursor else "")
        async with client.get(url) as response:
            page = orjson.loads(await response.read())
        seen += [r["request_id"] for r in page["records"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [f"p{i:02d}" for i in reversed(range(25))]
    middle = proxy.store.get("p10")
    assert middle is not None
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(middle.started_at)) + "Z"
    async with client.get(f"{proxy.admin_url}/api/requests?limit=1000&since={middle.started_at}") as response:
        assert [r["request_id"] for r in orjson.loads(await response.read())["records"]][-1] == "p10"
    async with client.get(f"{proxy.admin_url}/api/requests?since={since}&until={time.time() + 5}") as response:
        assert response.status == 200
    for bad in ("limit=1001", "cursor=abc", "since=yesterday", "concurrency=3"):
        async with client.get(f"{proxy.admin_url}/api/requests?{bad}") as response:
            assert response.status == 400, bad


# --- 9. headers the proxy changes ----------------------------------------------------------------

RAW_ANSWER = (b"HTTP/1.1 200 OK\r\nServer: upstream/1.0\r\nDate: Mon, 01 Jan 2024 00:00:00 GMT\r\n"
              b"X-Request-Id: upstream-own-id\r\nX-Utf8: caf\xc3\xa9\r\nContent-Length: 5\r\n\r\nplain")


async def test_the_upstreams_head_and_request_id_pass_unchanged(make_proxy: ProxyFactory) -> None:
    """Decided: the upstream's Server, Date and X-Request-Id pass as they are, no Content-Type is
    added to a body that had none, UTF-8 header values pass both ways (a byte that is not UTF-8
    is lost in aiohttp's parser: documented), trailers are dropped (aiohttp does not read them)."""
    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(RAW_ANSWER)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    proxy = await make_proxy(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    answer = await exchange(proxy.proxy_url, b"GET /v1/models HTTP/1.1\r\nHost: p\r\nX-Request-Id: mine\r\n"
                       b"X-Client-Utf8: caf\xc3\xa9\r\nConnection: close\r\n\r\n")
    server.close()
    head = answer.partition(b"\r\n\r\n")[0].lower()
    for line in (b"server: upstream/1.0", b"date: mon, 01 jan 2024 00:00:00 gmt", b"x-request-id: upstream-own-id",
                 b"x-utf8: caf\xc3\xa9", b"x-llm-diag-concurrency: 0"):
        assert line in head, line
    assert b"content-type" not in head  # the upstream sent none: none is added
    assert b"x-request-id: mine" in seen[0].lower() and b"x-client-utf8: caf\xc3\xa9" in seen[0].lower()
    record = await record_for(proxy, "mine")
    assert record.upstream_request_id == "upstream-own-id"
    assert proxy.store.get("upstream-own-id") is record


async def test_the_proxys_request_id_goes_upstream(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                    client: aiohttp.ClientSession) -> None:
    upstream.push(Script(openai_stream(2)))
    async with client.post(proxy.proxy_url + "/v1/chat/completions", json=CHAT) as response:
        await response.read()
        ours = response.headers["X-Request-Id"]
    assert {k.lower(): v for k, v in upstream.seen[-1].headers.items()}["x-request-id"] == ours


# --- 10. the admin API's authorization -----------------------------------------------------------

@pytest.mark.parametrize(("header", "status"), [
    (b"bearer admin-secret", 200), (b"BEARER admin-secret", 200), (b"Bearer admin-secret", 200),
    (b"Bearer wrong", 401), (b"Bearer caf\xc3\xa9", 401), (b"Bearer \xff\xfe", 401), (b"Basic YTpi", 401),
])
async def test_the_admin_token_is_checked_in_any_case_and_odd_bytes_are_a_401(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory, header: bytes, status: int) -> None:
    proxy = await make_proxy(upstream.url, admin_token="admin-secret")
    answer = await exchange(proxy.admin_url, b"GET /api/requests HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
                       b"Authorization: " + header + b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 %d" % status), answer[:100]


# --- 11. slow clients -----------------------------------------------------------------------------

SLOWLORIS = 500

async def test_connections_that_never_finish_their_head_are_closed_while_others_are_served(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory, client: aiohttp.ClientSession) -> None:
    proxy = await make_proxy(upstream.url, header_timeout_s=1.0)
    host, port = proxy.proxy_url.removeprefix("http://").split(":")
    slow: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    for _ in range(SLOWLORIS):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: p\r\nX-Slow: ")
        slow.append((reader, writer))
    for _i in range(5):  # normal traffic flows beside them
        async with client.get(proxy.proxy_url + "/v1/models") as response:
            assert response.status == 200
            await response.read()
    # A byte every 0.4 s to each one still open keeps none of them alive past the 1 s limit (a
    # timer that each byte restarted would never fire): all are closed within 4 s, however late
    # a busy machine accepted or timed some of them.
    ends = [asyncio.ensure_future(reader.read()) for reader, _ in slow]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 4.0
    while loop.time() < deadline and not all(end.done() for end in ends):
        for (_, writer), end in zip(slow, ends, strict=True):
            if not end.done() and not writer.is_closing():
                writer.write(b"x")
        await asyncio.sleep(0.4)
    # Closed is a FIN (EOF) or a reset: a close with a trickled byte still unread in the server's
    # socket is sent as RST by the kernel.
    closed = sum(end.done() and (isinstance(end.exception(), ConnectionError)
                                 or (end.exception() is None and end.result() == b"")) for end in ends)
    for (_, writer), end in zip(slow, ends, strict=True):
        end.cancel()
        writer.close()
    assert closed == SLOWLORIS


# --- 12. a client that half-closes ----------------------------------------------------------------

async def test_a_client_that_half_closes_after_its_request_is_treated_as_gone_like_nginx(
        upstream: ScriptedUpstream, proxy: RunningProxy) -> None:
    """Decided: a FIN from the client ends its exchange (nginx's default, proxy_ignore_client_abort
    off, does the same); the upstream request is cancelled and the record says client_disconnect."""
    upstream.push(Script(openai_stream(50), delay=0.02))
    host, port = proxy.proxy_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = orjson.dumps(CHAT)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nX-Request-Id: half\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    writer.write_eof()
    async with asyncio.timeout(5):
        received = await reader.read()
    writer.close()
    record = await record_for(proxy, "half")
    assert record.stop_reason == "client_disconnect" and len(received) < len(b"".join(openai_stream(50)))


# --- 11. text that is not UTF-8 --------------------------------------------------------------------

async def test_a_lone_surrogate_from_a_client_or_a_server_never_stops_the_history_metrics_or_log(
        tmp_path: Path) -> None:
    """A lone surrogate once stopped the history's writer for good (every later record unlisted)
    and turned /metrics into a 500 for good: a client's `\\ud800` escape in its model name (in a
    body past orjson's size, which the standard parser reads), or a server's X-Request-Id byte
    that is not UTF-8 (aiohttp decodes it as a surrogate). Each becomes `?` in the record."""
    answer = openai_completion(2)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().partition(b"content-length:")[2].split(b"\r\n")[0] or b"0")
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Request-Id: up-\xff\xfe\r\n"
                             b"Content-Length: %d\r\n\r\n%b" % (len(answer), answer))
                await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    served = await start_served(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", tmp_path,
                                "--history", str(tmp_path / "history.sqlite3"))
    try:
        big = b'{"model": "\\ud800m", "messages": [{"role": "user", "content": "%b"}]}' % (b"a" * 300_000)
        async with aiohttp.ClientSession() as client:
            for request_id, body in (("odd", big), ("plain", orjson.dumps(CHAT | {"stream": False}))):
                async with client.post(served.proxy_url + "/v1/chat/completions", data=body,
                                       headers={**JSON_HEADERS, "X-Request-Id": request_id}) as response:
                    assert response.status == 200 and await response.read() == answer
            async with client.get(served.admin_url + "/api/requests") as response:  # read-your-writes
                assert response.status == 200
                listed = {r["request_id"]: r for r in orjson.loads(await response.read())["records"]}
            async with client.get(served.admin_url + "/metrics") as response:
                assert response.status == 200
                metrics = await response.text()
    finally:
        served.stop()
        server.close()
    assert set(listed) == {"odd", "plain"}
    assert listed["odd"]["model"] == "?m" and listed["odd"]["upstream_request_id"] == "up-??"
    assert 'model="?m"' in metrics and "llm_proxy_history_up 1.0" in metrics
    assert "llm_proxy_history_dropped_total 0.0" in metrics
    logged = {line["request_id"]: line for line in served.lines() if line.get("event") == "response"}
    assert logged["odd"]["model"] == "?m" and "observer_errors" not in logged["odd"]
    assert not [line for line in served.lines() if line.get("level") in ("error", "warning")]
    assert "Traceback" not in served.log.read_text()


async def test_numbers_no_json_can_write_back_pass_unchanged_and_never_a_500(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory, client: aiohttp.ClientSession) -> None:
    """A body past orjson's size is read by the standard library's parser, which keeps integers of
    any size, `NaN` and `Infinity`. `float()` of a 400-digit temperature raised, and the proxy
    answered 500 without sending the request on: the request must go as it came, and the record
    leave such numbers out."""
    upstream.push(Script([openai_completion(3)], headers=JSON_HEADERS, content_length=True))
    huge = b"9" * 400
    body = (b'{"model": "m", "seed": %b, "max_tokens": %b, "temperature": %b, "top_p": NaN, "n": Infinity, '
            b'"messages": [{"role": "user", "content": "%b"}]}' % (huge, huge, huge, b"a" * 300_000))
    proxy = await make_proxy(upstream.url)
    async with client.post(proxy.proxy_url + "/v1/chat/completions", data=body,
                           headers={**JSON_HEADERS, "X-Request-Id": "huge"}) as response:
        assert response.status == 200 and await response.read() == openai_completion(3)
    assert upstream.seen[-1].body == body
    record = await record_for(proxy, "huge")
    assert (record.seed, record.requested_max_tokens, record.temperature, record.n) == (None, None, None, None)
    assert record.model == "m" and record.request_note is None and record.stop_reason == "eos"
    async with client.get(proxy.admin_url + "/api/requests") as response:
        assert response.status == 200
        assert [r["request_id"] for r in orjson.loads(await response.read())["records"]] == ["huge"]
