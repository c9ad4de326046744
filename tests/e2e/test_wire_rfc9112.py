"""Request targets and responses as RFC 9112 says, byte for byte with raw sockets: what the relay
refuses, what it keeps as it came (`OPTIONS *`, trailers), what it never adds (`Date`, `Server`),
and when a request may go twice."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time

import orjson
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.serve.app import RunningProxy
from tests.support.proxies import ProxyFactory, record_for
from tests.support.raw_http import ANSWER, OK, RawUpstream, exchange, head_lines


def split(answer: bytes) -> tuple[list[bytes], bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return head.split(b"\r\n"), body


def refused_counts(proxy: RunningProxy) -> dict[str, float]:
    text = generate_latest(proxy.metrics.registry).decode()
    return {s.labels["reason"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "llm_proxy_invalid_requests_total"}


def dechunked(body: bytes) -> tuple[bytes, bytes]:
    """A chunked body's data, and its trailer section (RFC 9112 7.1)."""
    data = b""
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return data, body
        data, body = data + body[:size], body[size + 2:]


# --- refused before anything goes upstream ------------------------------------------------------------

async def test_connect_is_refused_and_never_tunnels(raw: RawUpstream, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(raw.url())
    answer = await exchange(proxy.proxy_url, b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
    lines, body = split(answer)
    assert lines[0] == b"HTTP/1.1 405 Method Not Allowed"
    assert orjson.loads(body)["error"]["type"] == "method_not_allowed"
    assert raw.heads == [] and refused_counts(proxy)["connect"] == 1


async def test_connect_is_closed_at_once_without_aiohttps_c_parser(raw: RawUpstream) -> None:
    """aiohttp's pure-Python parser (no C extensions: AIOHTTP_NO_EXTENSIONS=1, or a platform without
    its wheels) takes a CONNECT's content as a body without end, and aiohttp lingered on it for 10 s
    after the 405 before it closed: a client could hold connections so. The proxy ends it at once."""
    env = {**os.environ, "AIOHTTP_NO_EXTENSIONS": "1", "PYTHONUNBUFFERED": "1"}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--upstream", raw.url(), "--listen", "127.0.0.1:0",
        "--admin-listen", "127.0.0.1:0", "--history", "off", "--gpu-poll-interval", "0", "--upstream-metrics", "off",
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert process.stdout is not None
    try:
        async with asyncio.timeout(20):
            while b'"listening"' not in (line := await process.stdout.readline()):
                assert line, "serve exited before listening"
        started = time.monotonic()
        answer = await exchange(orjson.loads(line)["proxy"],
                                b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
        assert time.monotonic() - started < 3
        assert answer.startswith(b"HTTP/1.1 405 Method Not Allowed\r\n") and b"Connection: close" in answer
        assert raw.heads == []
    finally:
        process.terminate()
        await process.wait()


async def test_a_request_line_without_a_version_is_refused_in_http_1_1(raw: RawUpstream,
                                                                       make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(raw.url())
    answer = await exchange(proxy.proxy_url, b"GET /v1/models\r\n\r\n")
    lines, body = split(answer)
    assert lines[0] == b"HTTP/1.1 400 Bad Request", answer[:80]
    assert b"Connection: close" in lines and orjson.loads(body)["error"]["type"] == "bad_request"
    # (aiohttp's pure-Python parser refuses the line itself: the same answer, counted as a bad request line)
    assert raw.heads == [] and refused_counts(proxy) in ({"http_0_9": 1}, {"bad_request_line": 1})


async def test_a_request_with_a_transfer_coding_other_than_chunked_is_501_or_400(
        raw: RawUpstream, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(raw.url())
    answer = await exchange(proxy.proxy_url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\n"
                            b"Transfer-Encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    assert answer.split(b"\r\n", 1)[0] in (b"HTTP/1.1 501 Not Implemented", b"HTTP/1.1 400 Bad Request")
    assert raw.heads == []


# --- targets and answers kept as they came ------------------------------------------------------------

async def test_options_asterisk_stays_an_asterisk_under_an_upstream_path(raw: RawUpstream,
                                                                         make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(raw.url() + "/base")
    answer = await exchange(proxy.proxy_url, b"OPTIONS * HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 OK")
    assert head_lines(raw.heads[0])[0] == b"OPTIONS * HTTP/1.1"
    await exchange(proxy.proxy_url, b"GET /v1/models HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
    assert head_lines(raw.heads[1])[0] == b"GET /base/v1/models HTTP/1.1"


async def test_a_target_goes_upstream_as_it_came_an_empty_query_included(raw: RawUpstream,
                                                                          make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(raw.url() + "/base")
    for target, sent in ((b"/v1/models?", b"/base/v1/models?"), (b"/v1/models??x", b"/base/v1/models??x"),
                         (b"/a?b=%20c&d", b"/base/a?b=%20c&d"), (b"/a#frag", b"/base/a"), (b"/a?#frag", b"/base/a?"),
                         (b"/v1//x/../y", b"/base/v1//x/../y"), (b"http://example.com/ok?", b"/base/ok?")):
        await exchange(proxy.proxy_url, b"GET " + target + b" HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
        assert head_lines(raw.heads[-1])[0] == b"GET " + sent + b" HTTP/1.1", target


async def test_the_proxy_adds_exactly_its_two_headers_and_no_date_or_server(raw: RawUpstream,
                                                                           make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(raw.url())
    answer = await exchange(proxy.proxy_url, b"GET /v1/models HTTP/1.1\r\nHost: h\r\nX-Request-Id: two\r\n"
                            b"Connection: close\r\n\r\n")
    lines, body = split(answer)
    names = [line.partition(b":")[0].lower() for line in lines[1:]]
    upstream_names = [line.partition(b":")[0].lower() for line in OK.split(b"\r\n\r\n")[0].split(b"\r\n")[1:]]
    assert body == ANSWER
    assert sorted(set(names) - set(upstream_names)) == [b"connection", b"x-llm-diag-concurrency", b"x-request-id"]
    assert b"date" not in names and b"server" not in names
    assert b"Content-Type: application/json" in lines and b"Content-Length: %d" % len(ANSWER) in lines


async def test_the_upstreams_own_date_and_server_pass_unchanged(raw: RawUpstream, make_proxy: ProxyFactory) -> None:
    raw.answer = (b"HTTP/1.1 200 OK\r\nDate: Sat, 05 Dec 2026 01:00:00 GMT\r\nServer: uvicorn\r\n"
                  b"Content-Length: 2\r\n\r\nok")
    proxy = await make_proxy(raw.url())
    lines, body = split(await exchange(proxy.proxy_url, b"GET /x HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"))
    assert b"Date: Sat, 05 Dec 2026 01:00:00 GMT" in lines and b"Server: uvicorn" in lines and body == b"ok"
    assert not any(line.startswith(b"Content-Type") for line in lines)  # none sent, none added


@pytest.mark.parametrize("framing", [b"content-length: 2\r\n\r\nok",
                                     b"transfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"],
                         ids=["a length", "chunked"])
async def test_field_names_pass_as_they_were_spelled_both_ways(raw: RawUpstream, make_proxy: ProxyFactory,
                                                               framing: bytes) -> None:
    """uvicorn (vLLM's server) names its fields lower-case; aiohttp's parser gives the names it knows
    its own spelling (`content-type` as `Content-Type`, `ETag` as `Etag`): the proxy passes them as
    they came, in both directions (the framing fields it sets itself are its own)."""
    raw.answer = b"HTTP/1.1 200 OK\r\ndate: Sat, 05 Dec 2026 01:00:00 GMT\r\nserver: uvicorn\r\n" \
                 b"content-type: text/event-stream\r\nETag: \"v1\"\r\nx-Custom: 1\r\n" + framing
    proxy = await make_proxy(raw.url())
    answer = await exchange(proxy.proxy_url, b"POST /v1/x HTTP/1.1\r\nhost: h\r\ncontent-type: application/json\r\n"
                            b"user-agent: raw\r\nACCEPT: */*\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}")
    lines, _ = split(answer)
    for line in (b"date: Sat, 05 Dec 2026 01:00:00 GMT", b"server: uvicorn", b"content-type: text/event-stream",
                 b'ETag: "v1"', b"x-Custom: 1"):
        assert line in lines, (line, lines)
    sent = head_lines(raw.heads[0])
    for line in (b"content-type: application/json", b"user-agent: raw", b"ACCEPT: */*"):
        assert line in sent, (line, sent)
    assert raw.bodies == [b"{}"]


@pytest.mark.parametrize(("framing", "request_version"), [
    (b"Content-Length: 2\r\n\r\nok", b"1.1"), (b"Transfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", b"1.1"),
    (b"Content-Length: 2\r\n\r\nok", b"1.0"), (b"Transfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", b"1.0"),
])
async def test_a_header_value_that_is_not_utf8_passes_byte_for_byte(raw: RawUpstream, make_proxy: ProxyFactory,
                                                                    framing: bytes, request_version: bytes) -> None:
    """aiohttp's own serializer drops such a byte (`caf\\xe9` went out as `caf`): the relay writes
    its heads itself, whatever the body's framing and the client's version."""
    raw.answer = b"HTTP/1.1 200 OK\r\nX-Note: caf\xe9 \xff\r\n" + framing
    proxy = await make_proxy(raw.url())
    answer = await exchange(proxy.proxy_url, b"GET /x HTTP/" + request_version + b"\r\nHost: h\r\n"
                            b"Connection: close\r\n\r\n")
    lines, _ = split(answer)
    assert b"X-Note: caf\xe9 \xff" in lines


async def test_the_proxys_own_answer_carries_no_server_version(make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy("http://127.0.0.1:9")  # nothing listens: the proxy answers itself
    lines, _ = split(await exchange(proxy.proxy_url, b"GET /x HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"))
    assert lines[0] == b"HTTP/1.1 502 Bad Gateway"
    assert not any(line.lower().startswith(b"server:") for line in lines)


async def test_chunked_trailers_reach_the_client_as_they_came(raw: RawUpstream, make_proxy: ProxyFactory) -> None:
    raw.answer = (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n"
                  b"Trailer: X-Checksum, X-Tokens\r\n\r\n"
                  b"5\r\nhello\r\n6\r\n world\r\n0\r\nX-Checksum: sha256=abc\r\nX-Tokens: 2\r\n\r\n")
    proxy = await make_proxy(raw.url())
    answer = await exchange(proxy.proxy_url, b"GET /x HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
    lines, body = split(answer)
    assert b"Transfer-Encoding: chunked" in lines and b"Trailer: X-Checksum, X-Tokens" in lines
    assert dechunked(body) == (b"hello world", b"X-Checksum: sha256=abc\r\nX-Tokens: 2\r\n\r\n")


async def test_a_chunked_answer_without_trailers_ends_plainly(raw: RawUpstream, make_proxy: ProxyFactory) -> None:
    raw.answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    proxy = await make_proxy(raw.url())
    _, body = split(await exchange(proxy.proxy_url, b"GET /x HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"))
    assert body.endswith(b"hello\r\n0\r\n\r\n")


async def test_a_chunked_body_reaches_the_client_framed_as_the_server_framed_it(
        raw: RawUpstream, make_proxy: ProxyFactory) -> None:
    """The relay passes a chunked body's framing through: sizes, extensions and data byte for byte."""
    framed = b"3;x=1\r\nabc\r\n1A\r\n" + b"z" * 26 + b"\r\n0001\r\n!\r\n"
    raw.answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + framed + b"0\r\n\r\n"
    proxy = await make_proxy(raw.url())
    _, body = split(await exchange(proxy.proxy_url, b"GET /x HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"))
    assert body == framed + b"0\r\n\r\n"


async def test_an_http_1_0_client_gets_a_chunked_answer_unframed(raw: RawUpstream, make_proxy: ProxyFactory) -> None:
    raw.answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    proxy = await make_proxy(raw.url())
    lines, body = split(await exchange(proxy.proxy_url, b"GET /x HTTP/1.0\r\nHost: h\r\n\r\n"))
    assert b"Transfer-Encoding: chunked" not in lines and body == b"hello world"


async def test_invalid_chunked_framing_breaks_the_client_connection_after_what_came_before_it(
        raw: RawUpstream, make_proxy: ProxyFactory) -> None:
    event = b"data: {}\n\n"
    raw.answer = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                  b"a\r\n" + event + b"\r\nzz\r\nbad\r\n0\r\n\r\n")
    proxy = await make_proxy(raw.url())
    request = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"x"}]}'
    _, body = split(await exchange(proxy.proxy_url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\n"
                                   b"X-Request-Id: bad-framing\r\nContent-Type: application/json\r\n"
                                   b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(request), request)))
    assert body == b"a\r\n" + event + b"\r\n"  # no last chunk: the client sees the body did not end
    record = await record_for(proxy, "bad-framing")
    assert record.upstream_error == "reset" and record.stop_reason == "upstream_disconnect"
    assert "invalid chunked framing" in (record.upstream_error_detail or "")


# --- answers not relayed --------------------------------------------------------------------------------

async def test_an_upgrade_nobody_asked_for_is_not_relayed(raw: RawUpstream, make_proxy: ProxyFactory) -> None:
    raw.answer = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    proxy = await make_proxy(raw.url())
    lines, body = split(await exchange(proxy.proxy_url, b"GET /x HTTP/1.1\r\nHost: h\r\nX-Request-Id: up\r\n"
                                                         b"Connection: close\r\n\r\n"))
    assert lines[0] == b"HTTP/1.1 502 Bad Gateway"
    assert orjson.loads(body)["error"]["type"] == "upstream_invalid_response"
    assert "101" in ((await record_for(proxy, "up")).upstream_error_detail or "")


async def test_a_transfer_coding_the_proxy_would_lose_is_refused_not_relayed(raw: RawUpstream,
                                                                               make_proxy: ProxyFactory) -> None:
    raw.answer = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
                  b"5\r\n\x1f\x8b\x08\x00\x00\r\n0\r\n\r\n")
    proxy = await make_proxy(raw.url())
    lines, body = split(await exchange(proxy.proxy_url, b"GET /x HTTP/1.1\r\nHost: h\r\nX-Request-Id: gz\r\n"
                                                         b"Connection: close\r\n\r\n"))
    assert lines[0] == b"HTTP/1.1 502 Bad Gateway"
    assert orjson.loads(body)["error"]["type"] == "upstream_invalid_response"
    record = await record_for(proxy, "gz")
    assert (record.status, record.stop_reason) == (502, "upstream_error")


# --- sent again only when not one byte of the answer came --------------------------------------------------

class BreaksMidHead:
    """Answers the first request of a connection; the second one gets the start of a status line, then
    the connection closes: an answer that began."""

    def __init__(self, partial: bytes) -> None:
        self.partial = partial
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            for number in range(2):
                self.requests.append(await reader.readuntil(b"\r\n\r\n"))
                if number == 0:
                    writer.write(OK)
                    await writer.drain()
                else:
                    writer.write(self.partial)
                    await writer.drain()
        writer.close()


@pytest.mark.parametrize(("partial", "again"), [(b"", True), (b"HTTP/1.1 200 OK\r\nContent-", False)],
                         ids=["no-byte", "begun"])
async def test_an_idempotent_request_goes_again_only_when_no_byte_of_its_answer_came(
        make_proxy: ProxyFactory, partial: bytes, again: bool) -> None:
    upstream = BreaksMidHead(partial)
    upstream.server = await asyncio.start_server(upstream.serve, "127.0.0.1", 0)
    try:
        proxy = await make_proxy(f"http://127.0.0.1:{upstream.server.sockets[0].getsockname()[1]}")
        first = await exchange(proxy.proxy_url, b"GET /a HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
        assert first.startswith(b"HTTP/1.1 200")
        second = await exchange(proxy.proxy_url, b"GET /b HTTP/1.1\r\nHost: h\r\nX-Request-Id: twice\r\n"
                                                 b"Connection: close\r\n\r\n")
        record = await record_for(proxy, "twice")
        sent = sum(1 for head in upstream.requests if head.startswith(b"GET /b"))
        if again:
            assert sent == 2 and record.upstream_retries == 1 and second.startswith(b"HTTP/1.1 200")
        else:
            assert sent == 1 and record.upstream_retries == 0 and second.startswith(b"HTTP/1.1 502")
    finally:
        upstream.server.close()
