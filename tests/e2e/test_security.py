"""Security defaults, tested: loopback binds, no secrets in records or logs, the admin token,
forwarding headers passed untouched and unused, and request smuggling refused at the door."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from proxy.config import ProxyConfig, parse_host_port
from proxy.serve.cli import build_parser, config_from_args
from tests.support.faulty_upstream import FaultyUpstream
from tests.support.proxies import ProxyFactory
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.wire import SSE_HEADERS, chat_chunk, sse

pytestmark = pytest.mark.timeout(120)

SECRETS = {
    "authorization": "Bearer sk-SECRET-AUTH-7f3a",
    "cookie": "session=SECRET-COOKIE-91bc",
    "x-api-key": "SECRET-XAPIKEY-22de",
    "api-key": "SECRET-AZUREKEY-5e11",
    "proxy-authorization": "Basic SECRET-PROXYAUTH-0c0c",
}
PROMPT_SECRET = "SECRET-PROMPT-my-password-is-hunter2"
COMPLETION_SECRET = "SECRET-COMPLETION-4111-1111-1111-1111"
QUERY_SECRET = "SECRET-QUERY-KEY-8d8d"
SET_COOKIE_SECRET = "SECRET-SETCOOKIE-a1a1"
ALL_SECRETS = [*SECRETS.values(), PROMPT_SECRET, COMPLETION_SECRET, QUERY_SECRET, SET_COOKIE_SECRET]


def secret_parts() -> list[str]:
    """Each secret and its distinctive core (so a truncated or re-quoted copy is caught too)."""
    return ALL_SECRETS + [re.search(r"SECRET-[A-Z]+", s).group(0) for s in ALL_SECRETS]  # type: ignore[union-attr]


def leaked(text: str) -> list[str]:
    return [s for s in secret_parts() if s in text]


def secret_stream() -> list[bytes]:
    return [sse(chat_chunk("", role=True)), sse(chat_chunk(f"the answer is {COMPLETION_SECRET}")),
            sse(chat_chunk(None, "stop")), b"data: [DONE]\n\n"]


def secret_request() -> dict[str, object]:
    return {"model": "m", "stream": True, "max_tokens": 16,
            "messages": [{"role": "user", "content": PROMPT_SECRET}]}


# --- loopback by default ---------------------------------------------------------------------

def test_config_defaults_bind_loopback_only() -> None:
    config = ProxyConfig()
    assert config.listen.host == "127.0.0.1" and config.admin_listen.host == "127.0.0.1"
    assert config.upstream.startswith("http://127.0.0.1:")
    assert config.admin_token is None and config.deadline_mode == "observe"
    assert parse_host_port(":8080").host == "127.0.0.1"  # a bare port means loopback, not all interfaces


def test_cli_defaults_bind_loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LLM_DIAG_LISTEN", "LLM_DIAG_ADMIN_LISTEN", "LLM_DIAG_UPSTREAM", "LLM_DIAG_ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    config = config_from_args(build_parser().parse_args(["serve"]))
    assert (config.listen.host, config.listen.port) == ("127.0.0.1", 8080)
    assert (config.admin_listen.host, config.admin_listen.port) == ("127.0.0.1", 9464)
    assert config.admin_token is None


async def test_started_proxy_listens_on_loopback_sockets_only(make_proxy: ProxyFactory,
                                                              upstream: ScriptedUpstream) -> None:
    proxy = await make_proxy(upstream.url)
    for runner in proxy.runners:
        for address in runner.addresses:
            assert address[0] == "127.0.0.1", address


# --- no secrets in records, logs or the record API --------------------------------------------

@pytest.fixture
async def secret_upstream() -> AsyncIterator[ScriptedUpstream]:
    server = ScriptedUpstream()
    server.default = Script(chunks=secret_stream(),
                            headers={**SSE_HEADERS, "Set-Cookie": f"sid={SET_COOKIE_SECRET}; HttpOnly"})
    await server.start()
    yield server
    await server.close()


async def test_serve_subprocess_never_logs_or_records_prompts_completions_or_credentials(
        secret_upstream: ScriptedUpstream) -> None:
    token = "admin-token-for-this-test"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--upstream", secret_upstream.url,
        "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--admin-token", token,
        "--log-format", "json", "--log-level", "debug", "--gpu-poll-interval", "0", "--upstream-metrics", "off",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert process.stdout is not None
    first_lines: list[bytes] = []
    try:
        async with asyncio.timeout(20):  # bounded: the `listening` line names both ports
            while True:
                line = await process.stdout.readline()
                assert line, "serve exited before listening"
                first_lines.append(line)
                if b'"listening"' in line:
                    listening = orjson.loads(line)
                    break
        base, admin = listening["proxy"], listening["admin"]
        async with aiohttp.ClientSession() as session:
            headers = {**SECRETS, "X-Request-Id": "secret-1"}
            async with session.post(f"{base}/v1/chat/completions?api_key={QUERY_SECRET}", json=secret_request(),
                                    headers=headers) as response:
                body = await response.read()
            assert COMPLETION_SECRET.encode() in body  # the client got its answer, unchanged
            seen = secret_upstream.seen[-1]
            assert seen.headers["Authorization"] == SECRETS["authorization"]  # forwarded, not consumed
            assert seen.headers["Cookie"] == SECRETS["cookie"]
            bearer = {"Authorization": f"Bearer {token}"}
            for _ in range(100):
                async with session.get(admin + "/api/requests/secret-1", headers=bearer) as one:
                    if one.status == 200:
                        record_text = await one.text()
                        break
                await asyncio.sleep(0.05)
            async with session.get(admin + "/api/requests?limit=100", headers=bearer) as listing:
                listing_text = await listing.text()
            async with session.get(admin + "/metrics") as metrics:
                metrics_text = await metrics.text()
    finally:
        process.terminate()
        stdout, stderr = await asyncio.wait_for(process.communicate(), 15)
    log = b"".join(first_lines).decode() + stdout.decode()
    responses = [orjson.loads(line) for line in log.splitlines() if line.startswith("{") and '"response"' in line]
    assert [r["request_id"] for r in responses if r.get("event") == "response"] == ["secret-1"]
    assert orjson.loads(record_text)["stop_reason"] == "eos"
    assert "api_key" not in orjson.loads(record_text)["path"]  # the query string is not recorded
    for name, text in (("log", log), ("stderr", stderr.decode()), ("record", record_text),
                       ("listing", listing_text), ("metrics", metrics_text)):
        assert leaked(text) == [], f"{name} leaks {leaked(text)}"


async def test_record_and_log_observer_hold_no_secrets_in_process(secret_upstream: ScriptedUpstream,
                                                                  make_proxy: ProxyFactory) -> None:
    import io

    from proxy.observers.logs import LogObserver, configure_logging

    stream = io.BytesIO()
    configure_logging("debug", "json", stream=stream)
    try:
        proxy = await make_proxy(secret_upstream.url)
        proxy.delivery.add(LogObserver(secret_upstream.url))
        async with aiohttp.ClientSession() as session, session.post(
                f"{proxy.proxy_url}/v1/chat/completions?key={QUERY_SECRET}", json=secret_request(),
                headers={**SECRETS, "X-Request-Id": "secret-2"}) as response:
            await response.read()
        for _ in range(100):
            if proxy.store.get("secret-2") is not None and stream.getvalue():
                break
            await asyncio.sleep(0.02)
        record = proxy.store.get("secret-2")
        assert record is not None and record.stop_reason == "eos"
        assert leaked(orjson.dumps(record.to_dict()).decode()) == []
        assert leaked(stream.getvalue().decode()) == []
        assert b'"event":"response"' in stream.getvalue()
    finally:
        configure_logging("info", "json")


# --- the admin token -------------------------------------------------------------------------

async def test_admin_token_guards_the_record_api_but_not_health_or_metrics(upstream: ScriptedUpstream,
                                                                           make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(upstream.url, admin_token="s3cret-admin")
    async with aiohttp.ClientSession() as session:
        for headers, want in (({}, 401), ({"Authorization": "Bearer wrong"}, 401),
                              ({"Authorization": "s3cret-admin"}, 401), ({"Authorization": "Basic s3cret-admin"}, 401),
                              ({"Authorization": "Bearer s3cret-admin"}, 200)):
            for path in ("/api/requests", "/api/requests/nope"):
                async with session.get(proxy.admin_url + path, headers=headers) as response:
                    status = response.status
                    body = await response.json()
                expected = want if want == 401 else (200 if path == "/api/requests" else 404)
                assert status == expected, (headers, path)
                if status == 401:
                    assert body["error"]["type"] == "unauthorized" and "s3cret" not in orjson.dumps(body).decode()
        for path in ("/healthz", "/metrics"):
            async with session.get(proxy.admin_url + path) as response:
                assert response.status == 200


# --- forwarding headers: passed through, never used ------------------------------------------

async def test_forwarded_headers_pass_unchanged_and_are_not_added_or_recorded(upstream: ScriptedUpstream,
                                                                              make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(upstream.url, admin_token="t")
    sent = {"X-Forwarded-For": "203.0.113.7, 198.51.100.1", "Forwarded": 'for=203.0.113.7;proto=https;by="[::1]"',
            "X-Forwarded-Host": "evil.example", "X-Forwarded-Proto": "https", "X-Real-IP": "203.0.113.7"}
    async with aiohttp.ClientSession() as session:
        async with session.get(proxy.proxy_url + "/v1/models", headers={**sent, "X-Request-Id": "fwd"}) as response:
            assert response.status == 200
        async with session.get(proxy.proxy_url + "/v1/models", headers={"X-Request-Id": "plain"}) as response:
            assert response.status == 200
        # the admin API does not trust them either: no token, no records, whatever the claimed client
        async with session.get(proxy.admin_url + "/api/requests",
                               headers={"X-Forwarded-For": "127.0.0.1", "X-Real-IP": "127.0.0.1"}) as response:
            assert response.status == 401
    with_headers, without = upstream.seen[-2], upstream.seen[-1]
    for name, value in sent.items():
        assert with_headers.headers[name] == value
    added = {"x-forwarded-for", "forwarded", "x-forwarded-host", "x-forwarded-proto", "x-real-ip", "via"}
    assert not added & {h.lower() for h in without.headers}  # the proxy adds none of its own
    for _ in range(100):
        if proxy.store.get("fwd") is not None:
            break
        await asyncio.sleep(0.01)
    record_text = orjson.dumps(proxy.store.get("fwd").to_dict()).decode()  # type: ignore[union-attr]
    assert "203.0.113.7" not in record_text and "evil.example" not in record_text


# --- request smuggling -----------------------------------------------------------------------

SMUGGLING = {
    "content-length and transfer-encoding": b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "two different content-lengths": b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}x",
    "two equal content-lengths": b"Content-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
    "content-length list": b"Content-Length: 2, 2\r\n\r\n{}",
    "signed content-length": b"Content-Length: +2\r\n\r\n{}",
    "obs-fold continuation line": b"X-Folded: a\r\n b\r\nContent-Length: 2\r\n\r\n{}",
    "unknown transfer-encoding": b"Transfer-Encoding: xchunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "chunked not last": b"Transfer-Encoding: chunked, identity\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "space before colon": b"Transfer-Encoding : chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "transfer-encoding twice": b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "NUL in a header": b"X-A: a\x00b\r\nContent-Length: 2\r\n\r\n{}",
    "bare LF line ends": b"Content-Length: 2\n\n{}",
}
REQUEST_LINE = b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nX-Request-Id: smuggle\r\n"


async def raw_exchange(proxy_url: str, raw: bytes, responses: int = 1) -> bytes:
    host, port = proxy_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(raw)
    await writer.drain()
    data = b""
    try:
        async with asyncio.timeout(5):
            while data.count(b"HTTP/1.") < responses or not data.endswith((b"\r\n\r\n", b"}", b"\n\n")):
                piece = await reader.read(65536)
                if not piece:
                    break
                data += piece
    except TimeoutError:
        pass
    finally:
        writer.close()
    return data


@pytest.fixture
async def raw_upstream() -> AsyncIterator[FaultyUpstream]:
    server = FaultyUpstream()
    await server.start()
    yield server
    await server.close()


@pytest.mark.parametrize("attempt", list(SMUGGLING))
async def test_request_smuggling_attempt_is_refused_before_anything_reaches_the_upstream(
        attempt: str, raw_upstream: FaultyUpstream, make_proxy: ProxyFactory,
        caplog: pytest.LogCaptureFixture) -> None:
    proxy = await make_proxy(raw_upstream.url)
    caplog.set_level(logging.DEBUG, logger="aiohttp")
    data = await raw_exchange(proxy.proxy_url, REQUEST_LINE + SMUGGLING[attempt])
    assert data.split(b"\r\n", 1)[0].endswith(b" 400 Bad Request"), data[:200]
    await asyncio.sleep(0.05)
    assert raw_upstream.received == []  # nothing was forwarded
    assert proxy.store.total == 0  # no request was admitted, so there is nothing to diagnose
    # a hostile client gets one warning line per attempt, never a traceback to fill the log with
    server_lines = [r for r in caplog.records if r.name.startswith("aiohttp")]
    assert server_lines and all(r.exc_info is None and "\n" not in r.getMessage() for r in server_lines)


async def test_pipelined_request_after_a_chunked_body_is_reframed_as_its_own_request(
        raw_upstream: FaultyUpstream, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(raw_upstream.url)
    raw = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nX-Request-Id: first\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
           b"GET /smuggled HTTP/1.1\r\nHost: proxy\r\nX-Request-Id: second\r\n\r\n")
    data = await raw_exchange(proxy.proxy_url, raw, responses=2)
    assert data.count(b"HTTP/1.1 200 OK") == 2
    first, second = raw_upstream.received
    # the proxy re-frames: the upstream sees exactly the requests the proxy parsed, each whole
    assert first.head.startswith(b"POST /v1/chat/completions ") and first.body == b"{}"
    assert first.headers.get("content-length") == "2" and "transfer-encoding" not in first.headers
    assert second.head.startswith(b"GET /smuggled ") and second.body == b""
    for _ in range(100):
        if proxy.store.total == 2:
            break
        await asyncio.sleep(0.01)
    assert {proxy.store.get("first").path, proxy.store.get("second").path} == {  # type: ignore[union-attr]
        "/v1/chat/completions", "/smuggled"}
