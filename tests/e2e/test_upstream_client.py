"""The proxy's own HTTP/1.1 client to the upstream, byte for byte: the request head the upstream
reads (Host first, the client's headers in its order, nothing added), the bodies' framing, the
answers it passes over (1xx), a path prefix, HEAD, TLS, and idle connections closed on time."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from proxy.serve.app import RunningProxy
from tests.support.proxies import ProxyFactory, record_for
from tests.support.raw_http import ANSWER, OK, RawUpstream, exchange, head_lines
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.wire import chat_chunk, sse


async def test_the_upstream_reads_the_clients_head_with_host_first_and_nothing_added(
        raw: RawUpstream, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(raw.url())
    body = b'{"model":"m","messages":[]}'
    answer = await exchange(proxy.proxy_url, b"POST /v1/chat/completions?x=1%%20y HTTP/1.1\r\nHost: client.example\r\n"
                            b"X-Custom: A\r\nx-custom: b\r\nContent-Length: %d\r\nX-Request-Id: raw-1\r\n"
                            b"Connection: close\r\n\r\n%s" % (len(body), body))
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(ANSWER)
    port = raw.url().rsplit(":", 1)[1].encode()
    assert head_lines(raw.heads[0]) == [
        b"POST /v1/chat/completions?x=1%20y HTTP/1.1", b"Host: 127.0.0.1:" + port,
        b"X-Custom: A", b"x-custom: b", b"X-Request-Id: raw-1", b"Content-Length: %d" % len(body)]
    assert raw.bodies == [body]


async def test_a_post_without_a_body_says_length_zero_and_a_get_says_nothing(
        raw: RawUpstream, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(raw.url())
    await exchange(proxy.proxy_url, b"POST /v1/x HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
    await exchange(proxy.proxy_url, b"GET /v1/models HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
    assert b"Content-Length: 0" in head_lines(raw.heads[0])
    assert not any(line.lower().startswith(b"content-length") for line in head_lines(raw.heads[1]))
    assert raw.connections == 1  # both on one pooled connection


async def test_a_chunked_body_over_the_parse_cap_goes_upstream_chunked_and_whole(
        raw: RawUpstream, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(raw.url(), request_body_cap_bytes=64)
    pieces = [b'{"model":"m","messages":[{"role":"user","content":"', b"x" * 300, b'"}]}']
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    answer = await exchange(proxy.proxy_url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nX-Request-Id: big\r\n"
                            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + chunked)
    assert answer.endswith(ANSWER)
    assert b"Transfer-Encoding: chunked" in head_lines(raw.heads[0])
    assert raw.bodies == [b"".join(pieces)]
    assert "parse cap" in ((await record_for(proxy, "big")).request_note or "")


async def test_informational_answers_before_the_final_one_are_passed_over(
        raw: RawUpstream, make_proxy: ProxyFactory) -> None:
    raw.answer = b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n" + OK
    proxy = await make_proxy(raw.url())
    answer = await exchange(proxy.proxy_url, b"GET /v1/models HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(ANSWER)
    assert b"103" not in answer.split(b"\r\n")[0]


async def test_a_path_in_the_upstream_url_leads_every_request_target(
        raw: RawUpstream, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(raw.url() + "/prefix/")
    await exchange(proxy.proxy_url, b"GET /v1/models?a=b HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
    assert head_lines(raw.heads[0])[0] == b"GET /prefix/v1/models?a=b HTTP/1.1"


async def test_a_head_answer_has_no_body_and_its_connection_carries_the_next_request(
        raw: RawUpstream, make_proxy: ProxyFactory) -> None:
    raw.answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n"
    proxy = await make_proxy(raw.url())
    answer = await exchange(proxy.proxy_url, b"HEAD /v1/models HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"\r\n\r\n")
    raw.answer = OK
    assert (await exchange(proxy.proxy_url, b"GET /v1/models HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
            ).endswith(ANSWER)
    assert raw.connections == 1


async def test_an_idle_pooled_connection_is_closed_after_the_pools_idle_time(
        raw: RawUpstream, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    import proxy.relay.upstream.pool as upstream_client

    monkeypatch.setattr(upstream_client, "POOLED_IDLE_S", 0.2)
    monkeypatch.setattr(upstream_client, "SWEEP_EVERY_S", 0.1)
    proxy = await make_proxy(raw.url())
    await exchange(proxy.proxy_url, b"GET /v1/models HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
    assert (raw.connections, raw.closed) == (1, 0)
    for _ in range(100):
        await asyncio.sleep(0.05)
        if raw.closed:
            break
    assert raw.closed == 1  # the proxy closed it, never the server


def self_signed(where: Path) -> tuple[Path, Path]:
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


@pytest.fixture
async def tls_upstream(tmp_path: Path) -> AsyncIterator[tuple[RawUpstream, Path]]:
    cert, key = self_signed(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    upstream = RawUpstream()
    upstream.server = await asyncio.start_server(upstream.serve, "127.0.0.1", 0, ssl=context)
    yield upstream, cert
    upstream.server.close()


async def test_a_tls_upstream_the_system_trusts_is_relayed(
        tls_upstream: tuple[RawUpstream, Path], make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    upstream, cert = tls_upstream
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # read when the proxy makes its TLS context
    proxy = await make_proxy(upstream.url("https"))
    answer = await exchange(proxy.proxy_url, b"GET /v1/models HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
    assert answer.endswith(ANSWER)


async def test_a_tls_upstream_whose_certificate_does_not_verify_is_a_502_and_never_asked(
        tls_upstream: tuple[RawUpstream, Path], make_proxy: ProxyFactory) -> None:
    upstream, _ = tls_upstream
    proxy = await make_proxy(upstream.url("https"))
    answer = await exchange(proxy.proxy_url, b"GET /v1/models HTTP/1.1\r\nHost: h\r\nX-Request-Id: tls-bad\r\n"
                            b"Connection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 502 ")
    error = orjson.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    assert error["type"] == "upstream_unavailable" and "certificate" in error["message"].lower()
    assert upstream.heads == []
    assert (await record_for(proxy, "tls-bad")).upstream_error == "connect"


async def test_streams_the_client_left_leave_no_connection_behind_in_the_pool(
        upstream: ScriptedUpstream, proxy: RunningProxy, client: aiohttp.ClientSession) -> None:
    """A stream cut because its client left closes its upstream connection, and the pool forgets
    it: nothing of it stays among the connections resting after a stream."""
    for i in range(5):
        upstream.push(Script(chunks=[sse(chat_chunk("x"))] * 100, delay=0.01))
        async with client.post(proxy.proxy_url + "/v1/chat/completions", data=b'{"model":"m","stream":true}',
                               headers={"X-Request-Id": f"left-{i}"}) as response:
            await response.content.readany()
        record = await record_for(proxy, f"left-{i}")
        assert record.stop_reason == "client_disconnect"
    pool = proxy.forwarder.pool
    assert not pool._idle  # (a connection keeps its own resting state: no set of streamed ones to leak)
