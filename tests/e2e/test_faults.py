"""Fault injection: an upstream or a client that misbehaves gets the most honest answer the proxy
can give (a JSON 502/504 while the client is still there), leaves a record that names the fault,
and does not disturb a healthy stream running beside it (it completes, byte for byte)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.serve.app import RunningProxy
from tests.e2e.load.resources import fd_census, raise_fd_limit, rss_bytes, settle_memory
from tests.support.faulty_upstream import BIG_BODY_SIZE, HEALTHY_BODY, MIB, FaultyUpstream, big_body_block
from tests.support.proxies import ProxyFactory, record_for

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def faulty() -> AsyncIterator[FaultyUpstream]:
    server = FaultyUpstream()
    await server.start()
    yield server
    await server.close()


async def healthy_stream(proxy: RunningProxy, request_id: str = "healthy") -> None:
    """A normal stream through the same proxy: it must end complete and byte-identical."""
    async with aiohttp.ClientSession(auto_decompress=False) as session, session.post(
            proxy.proxy_url + "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": request_id}) as response:
        body = await response.read()
    assert response.status == 200
    assert body == HEALTHY_BODY
    assert (await record_for(proxy, request_id)).stop_reason == "eos"


async def beside_healthy(proxy: RunningProxy, fault: Awaitable[Any]) -> Any:
    """Run `fault` with a healthy stream started just before it; returns the fault's result."""
    healthy = asyncio.create_task(healthy_stream(proxy))
    await asyncio.sleep(0.02)
    try:
        return await fault
    finally:
        await healthy


async def post(proxy: RunningProxy, fault: str, request_id: str,
               timeout: float = 30.0) -> tuple[int, dict[str, Any] | None, bytes, str | None]:
    """(status, JSON body if any, raw body read, the client-side error if the body broke)."""
    timeouts = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(auto_decompress=False, timeout=timeouts) as session, session.post(
            proxy.proxy_url + "/v1/chat/completions", json=CHAT,
            headers={"X-Fault": fault, "X-Request-Id": request_id}) as response:
        try:
            body = await response.read()
            error = None
        except aiohttp.ClientPayloadError as exc:
            body, error = b"", type(exc).__name__
        parsed = orjson.loads(body) if response.content_type == "application/json" and body else None
        return response.status, parsed, body, error


# --- the upstream misbehaves -----------------------------------------------------------------

async def test_refused_connection_is_a_json_502_recorded_as_connect_error(make_proxy: ProxyFactory) -> None:
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proxy = await make_proxy(f"http://127.0.0.1:{port}")
    status, body, _, _ = await post(proxy, "healthy", "refused")
    assert status == 502
    assert body is not None and body["error"]["type"] == "upstream_unavailable"
    assert body["error"]["source"] == "llm-diag-proxy"
    record = await record_for(proxy, "refused")
    assert (record.stop_reason, record.upstream_error) == ("upstream_error", "connect")
    # the upstream comes back on that port: the same proxy serves it at once
    upstream = FaultyUpstream()
    await upstream.start(port)
    try:
        await healthy_stream(proxy)
    finally:
        await upstream.close()


async def test_a_connect_that_times_out_is_a_json_504_recorded_as_timeout_not_as_a_deadline(
        make_proxy: ProxyFactory) -> None:
    # A listener whose accept queue is full: the kernel drops further SYNs, so a connect hangs.
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        port = full.getsockname()[1]
        queued = []
        for _ in range(4):
            waiting = socket.socket()
            waiting.setblocking(False)
            waiting.connect_ex(("127.0.0.1", port))
            queued.append(waiting)
        try:
            proxy = await make_proxy(f"http://127.0.0.1:{port}", connect_timeout_s=0.5)
            status, body, _, _ = await post(proxy, "healthy", "slow-connect")
        finally:
            for waiting in queued:
                waiting.close()
    assert status == 504
    assert body is not None and body["error"]["type"] == "upstream_timeout"
    record = await record_for(proxy, "slow-connect")
    assert (record.stop_reason, record.upstream_error, record.deadline_hit) == ("upstream_error", "timeout", "none")


async def test_reset_after_accept_is_a_json_502_recorded_as_reset(faulty: FaultyUpstream,
                                                                  make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(faulty.url)
    status, body, _, _ = await beside_healthy(proxy, post(proxy, "reset", "reset"))
    assert status == 502 and body is not None and body["error"]["type"] == "upstream_reset"
    record = await record_for(proxy, "reset")
    assert (record.stop_reason, record.upstream_error) == ("upstream_error", "reset")


async def test_headers_then_hang_ends_visibly_at_the_idle_timeout(faulty: FaultyUpstream,
                                                                  make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(faulty.url, idle_timeout_s=0.5, deadline_mode="enforce")
    status, _, body, error = await beside_healthy(proxy, post(proxy, "headers_then_hang", "hang"))
    assert status == 200 and error is None
    assert body.endswith(b"\n\n") and b'"idle_timeout"' in body.rsplit(b"data: ", 1)[1]
    assert b"[DONE]" not in body
    record = await record_for(proxy, "hang")
    assert record.stop_reason == "idle_timeout" and record.deadline_hit == "idle"


async def test_no_answer_at_all_is_a_json_504_at_the_deadline(faulty: FaultyUpstream,
                                                             make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(faulty.url, deadline_s=0.8, deadline_mode="enforce")
    status, body, _, _ = await post(proxy, "no_answer", "silent")
    assert status == 504 and body is not None and body["error"]["type"] == "deadline_exceeded"
    record = await record_for(proxy, "silent")
    assert record.stop_reason == "deadline" and record.deadline_hit == "total"


async def test_no_answer_with_default_config_waits_for_the_client_and_frees_the_upstream(
        faulty: FaultyUpstream, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(faulty.url)  # no deadline by default: the client decides how long to wait
    with pytest.raises(TimeoutError):
        await beside_healthy(proxy, post(proxy, "no_answer", "patient", timeout=0.5))
    record = await record_for(proxy, "patient")
    assert record.stop_reason == "client_disconnect" and record.disconnect_phase == "before_first_token"
    for _ in range(200):  # the proxy closed its upstream connection too
        if faulty.disconnects or proxy.concurrency.in_flight == 0:
            break
        await asyncio.sleep(0.01)
    assert proxy.concurrency.in_flight == 0


async def test_truncated_chunked_body_breaks_the_client_connection_and_is_recorded_as_reset(
        faulty: FaultyUpstream, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(faulty.url)
    status, _, _, error = await beside_healthy(proxy, post(proxy, "truncated_chunked", "truncated"))
    assert status == 200
    assert error == "ClientPayloadError"  # the client sees a broken body, never a clean end
    record = await record_for(proxy, "truncated")
    assert (record.stop_reason, record.upstream_error) == ("upstream_disconnect", "reset")


async def test_invalid_chunk_size_mid_body_is_recorded_as_reset(faulty: FaultyUpstream,
                                                                make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(faulty.url)
    status, _, _, error = await beside_healthy(proxy, post(proxy, "bad_chunk_size", "badchunk"))
    assert status == 200 and error == "ClientPayloadError"
    record = await record_for(proxy, "badchunk")
    assert (record.stop_reason, record.upstream_error) == ("upstream_disconnect", "reset")


@pytest.mark.parametrize("fault", ["invalid_http", "huge_header"])
async def test_unparseable_response_head_is_a_json_502_that_says_so(fault: str, faulty: FaultyUpstream,
                                                                    make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(faulty.url)
    status, body, _, _ = await beside_healthy(proxy, post(proxy, fault, fault))
    assert status == 502 and body is not None and body["error"]["source"] == "llm-diag-proxy"
    assert body["error"]["type"] == "upstream_invalid_response"
    record = await record_for(proxy, fault)
    assert (record.stop_reason, record.upstream_error) == ("upstream_error", "reset")
    detail = record.upstream_error_detail or ""
    print(f"\n{fault}: {body['error']['type']}: {detail}")
    assert detail.startswith("upstream answered with a response that is not valid HTTP")
    assert "closed the connection" not in detail  # it did answer; it answered garbage


async def test_hundred_mib_json_body_passes_whole_with_bounded_memory(faulty: FaultyUpstream,
                                                                     make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(faulty.url)
    before = settle_memory()
    peak = before
    digest = hashlib.sha256()

    async def fetch() -> int:
        nonlocal peak
        size = 0
        async with aiohttp.ClientSession(auto_decompress=False) as session, session.post(
                proxy.proxy_url + "/v1/chat/completions", json={**CHAT, "stream": False},
                headers={"X-Fault": "big_body", "X-Request-Id": "big"}) as response:
            assert response.status == 200 and response.content_length == BIG_BODY_SIZE
            async for piece in response.content.iter_chunked(MIB):
                digest.update(piece)
                size += len(piece)
                peak = max(peak, rss_bytes())
        return size

    size = await beside_healthy(proxy, fetch())
    expected = hashlib.sha256()
    block = big_body_block()
    for _ in range(BIG_BODY_SIZE // len(block)):
        expected.update(block)
    assert size == BIG_BODY_SIZE and digest.digest() == expected.digest()
    record = await record_for(proxy, "big")
    assert record.bytes_out == BIG_BODY_SIZE
    # judged on its Content-Length against the 32 MiB cap: not read, and it says so; no guess
    assert record.parse_error and "parse cap" in (record.parse_error_detail or "")
    assert record.stop_reason == "unknown"
    growth = (peak - before) / MIB
    print(f"\n100 MiB JSON body: proxy RSS growth peak {growth:.1f} MiB (parse cap 32 MiB)")
    assert growth < 24  # buffers only: no byte of a body declared over the cap is held


# --- the client misbehaves -------------------------------------------------------------------

async def slow_body(proxy: RunningProxy, fault: str, request_id: str, body: bytes, pieces: int,
                    pause: float) -> tuple[int, bytes]:
    async def trickle() -> AsyncIterator[bytes]:
        step = max(1, len(body) // pieces)
        for start in range(0, len(body), step):
            yield body[start:start + step]
            await asyncio.sleep(pause)

    async with aiohttp.ClientSession(auto_decompress=False) as session, session.post(
            proxy.proxy_url + "/v1/chat/completions", data=trickle(),
            headers={"X-Fault": fault, "X-Request-Id": request_id, "Content-Type": "application/json"}) as response:
        return response.status, await response.read()


async def test_slow_request_body_under_the_parse_cap_reaches_the_upstream_whole(
        faulty: FaultyUpstream, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(faulty.url)
    body = orjson.dumps(CHAT)
    status, answer = await beside_healthy(proxy, slow_body(proxy, "want_body_fast", "slowbody", body, 8, 0.1))
    # the proxy reads a body under its parse cap before it connects: the impatient upstream never waits
    assert status == 200 and answer == HEALTHY_BODY
    assert faulty.received[-1].body == body and faulty.received[-1].complete
    assert (await record_for(proxy, "slowbody")).stop_reason == "eos"


async def test_slow_request_body_over_the_parse_cap_streams_and_the_upstream_verdict_is_recorded(
        faulty: FaultyUpstream, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(faulty.url, request_body_cap_bytes=64)
    body = orjson.dumps({**CHAT, "padding": "p" * 400})
    status, answer = await beside_healthy(proxy, slow_body(proxy, "want_body_fast", "slowbig", body, 8, 0.1))
    assert status == 408 and orjson.loads(answer) == {"error": "request body too slow"}
    record = await record_for(proxy, "slowbig")
    assert (record.stop_reason, record.upstream_error, record.status) == ("upstream_error", "http_status", 408)


async def test_client_gone_during_request_body_leaves_a_record_and_sends_nothing_upstream(
        faulty: FaultyUpstream, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(faulty.url)
    host, port = proxy.proxy_url.removeprefix("http://").split(":")

    async def abandon() -> None:
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"X-Request-Id: abandoned\r\nContent-Length: 100000\r\n\r\n" + b'{"model": "m", "mess')
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()
        await writer.wait_closed()

    await beside_healthy(proxy, abandon())
    record = await record_for(proxy, "abandoned")
    assert record.stop_reason == "client_disconnect" and record.client_disconnected
    assert not any(b"abandoned" in r.head for r in faulty.received)  # the half body never went upstream
    assert proxy.concurrency.in_flight == 0


async def test_five_thousand_idle_connections_do_not_stop_a_healthy_stream(
        faulty: FaultyUpstream, make_proxy: ProxyFactory) -> None:
    idle = 5000
    if raise_fd_limit(2 * idle + 1024) < 2 * idle + 512:
        pytest.skip(f"needs {2 * idle + 512} open files; the hard limit is lower")
    proxy = await make_proxy(faulty.url)
    port = int(proxy.proxy_url.rsplit(":", 1)[1])
    before_fds = fd_census((port,)).without(port)
    before = settle_memory()
    writers: list[asyncio.StreamWriter] = []
    try:
        for start in range(0, idle, 100):  # in batches well under the listen backlog: a burst beyond
            opened = await asyncio.gather(*(asyncio.open_connection("127.0.0.1", port)  # it is dropped
                                            for _ in range(start, min(idle, start + 100))))  # by the kernel
            writers.extend(w for _, w in opened)  # before the proxy could accept it (test_burst.py)
            for _ in range(100):
                if fd_census((port,)).touching[port] >= 2 * len(writers):
                    break
                await asyncio.sleep(0.01)
        for index, writer in enumerate(writers):  # half of them start a request line and stop
            if index % 2:
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        for _ in range(200):  # the proxy accepts at its own pace (a backlog's worth per loop turn)
            census = fd_census((port,))
            if census.touching[port] >= 2 * idle:
                break
            await asyncio.sleep(0.05)
        held = rss_bytes() - before
        await healthy_stream(proxy, "beside-5000")
        print(f"\n{idle} idle connections: {census.touching[port]} sockets on the proxy port (both ends), "
              f"RSS +{held / MIB:.1f} MiB ({held / idle / 1024:.1f} KiB each, both ends)")
        assert census.touching[port] == 2 * idle  # all held open at once, none refused or dropped
    finally:
        for writer in writers:
            writer.close()
        with contextlib.suppress(Exception):
            await asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True)
    for _ in range(200):
        if fd_census((port,)).touching[port] == 0:
            break
        await asyncio.sleep(0.025)
    after = fd_census((port,))
    assert after.touching[port] == 0  # every idle connection closed on the proxy side too
    assert after.without(port) <= before_fds + 8
    assert proxy.concurrency.in_flight == 0
