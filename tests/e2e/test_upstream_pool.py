"""The upstream connection pool: connections are reused; a pooled connection the server closed while
it sat idle is never written on (a fresh one is opened); and a request the server may have read is
never sent twice: a POST that dies on a reused connection is a 502, a GET is sent again."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest

from tests.support.keepalive_upstream import ANSWER, REQUEST, STREAM_REQUEST, KeepAliveUpstream
from tests.support.proxies import ProxyFactory, record_for


async def post(session: aiohttp.ClientSession, url: str, request_id: str, body: bytes = REQUEST) -> tuple[int, bytes]:
    async with session.post(url + "/v1/chat/completions", data=body, headers={
            "Content-Type": "application/json", "X-Request-Id": request_id}) as response:
        return response.status, await response.read()


async def test_sequential_requests_share_one_upstream_connection(
        keepalive: KeepAliveUpstream, make_proxy: ProxyFactory, client: aiohttp.ClientSession) -> None:
    proxy = await make_proxy(keepalive.url)
    for i in range(5):
        assert await post(client, proxy.proxy_url, f"pool-{i}") == (200, ANSWER)
    assert keepalive.connections == 1
    assert keepalive.answered == 5
    assert (await record_for(proxy, "pool-4")).upstream_retries == 0


async def test_a_post_the_server_read_and_then_dropped_is_never_sent_again(
        keepalive: KeepAliveUpstream, make_proxy: ProxyFactory, client: aiohttp.ClientSession) -> None:
    """RFC 9112 section 9.3.1: the server read the second request, then closed. Sending it again
    would make it generate twice: the client gets a 502 and the server saw the request once."""
    keepalive.answer_per_connection = 1
    proxy = await make_proxy(keepalive.url)
    assert await post(client, proxy.proxy_url, "first") == (200, ANSWER)
    status, body = await post(client, proxy.proxy_url, "second")
    assert status == 502 and orjson.loads(body)["error"]["type"] == "upstream_reset"
    record = await record_for(proxy, "second")
    assert (record.upstream_retries, record.stop_reason, record.upstream_error) == (0, "upstream_error", "reset")
    assert (keepalive.connections, keepalive.answered, keepalive.dropped) == (1, 1, 1)
    assert keepalive.bodies == [REQUEST]


async def test_an_idempotent_request_on_a_dead_pooled_connection_is_sent_again(
        keepalive: KeepAliveUpstream, make_proxy: ProxyFactory, client: aiohttp.ClientSession) -> None:
    keepalive.answer_per_connection = 1
    proxy = await make_proxy(keepalive.url)
    assert await post(client, proxy.proxy_url, "first") == (200, ANSWER)
    async with client.get(proxy.proxy_url + "/v1/models", headers={"X-Request-Id": "again"}) as response:
        assert (response.status, await response.read()) == (200, ANSWER)
    record = await record_for(proxy, "again")
    assert record.upstream_retries == 1 and (keepalive.connections, keepalive.dropped) == (2, 1)
    async with client.get(proxy.admin_url + "/metrics") as response:
        assert "llm_proxy_upstream_retries_total 1.0\n" in await response.text()


async def test_a_server_that_closes_after_every_answer_never_costs_a_502(
        keepalive: KeepAliveUpstream, make_proxy: ProxyFactory, client: aiohttp.ClientSession) -> None:
    """llama-server's habit: `Connection: keep-alive`, then a close. The pooled connection is found
    closed before it carries the next request, which goes out on a fresh one."""
    keepalive.close_after_answer = True
    proxy = await make_proxy(keepalive.url)
    for i in range(40):
        assert await post(client, proxy.proxy_url, f"closing-{i}") == (200, ANSWER)
        if i % 2:
            await asyncio.sleep(0.005)  # half the time the event loop has seen the server's FIN, half not
    assert (keepalive.connections, keepalive.answered, keepalive.dropped) == (40, 40, 0)
    for i in range(40):
        assert (await record_for(proxy, f"closing-{i}")).upstream_retries == 0


async def test_a_request_right_after_a_stream_never_meets_the_servers_close_on_its_way(
        keepalive: KeepAliveUpstream, make_proxy: ProxyFactory, client: aiohttp.ClientSession) -> None:
    """llama-server closes a few ms after a stream's last byte: too late for the pool's look to see,
    soon enough to lose the next request. A connection that carried a stream rests before reuse."""
    keepalive.close_after_stream_s = 0.02
    proxy = await make_proxy(keepalive.url)
    for i in range(20):
        status, _ = await post(client, proxy.proxy_url, f"stream-{i}", STREAM_REQUEST)
        assert status == 200
        assert await post(client, proxy.proxy_url, f"next-{i}") == (200, ANSWER)
    assert keepalive.answered == 40
    assert proxy.store.get("next-19").stop_reason == "eos"  # type: ignore[union-attr]


async def test_a_fresh_connection_that_dies_is_not_retried(
        keepalive: KeepAliveUpstream, make_proxy: ProxyFactory, client: aiohttp.ClientSession) -> None:
    keepalive.answer_per_connection = 0  # the server may have seen it: sending again is not safe
    proxy = await make_proxy(keepalive.url)
    status, body = await post(client, proxy.proxy_url, "fresh")
    assert status == 502
    assert orjson.loads(body)["error"]["type"] == "upstream_reset"
    record = await record_for(proxy, "fresh")
    assert (record.upstream_retries, record.upstream_error) == (0, "reset")
    assert (keepalive.connections, keepalive.dropped) == (1, 1)


async def test_a_streamed_request_body_is_not_sent_twice(
        keepalive: KeepAliveUpstream, make_proxy: ProxyFactory, client: aiohttp.ClientSession) -> None:
    keepalive.answer_per_connection = 1
    proxy = await make_proxy(keepalive.url, request_body_cap_bytes=1024)
    assert await post(client, proxy.proxy_url, "small") == (200, ANSWER)
    big = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 4096}]})
    status, _ = await post(client, proxy.proxy_url, "big", big)  # over the cap: streamed, not replayable
    assert status == 502
    record = await record_for(proxy, "big")
    assert (record.upstream_retries, record.upstream_error) == (0, "reset")
    assert keepalive.dropped == 1


def test_an_idle_connection_the_peer_closed_is_readable_one_still_open_is_not() -> None:
    import socket

    from proxy.relay.upstream.connection import readable

    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        try:
            assert not readable(client.fileno())  # idle and open: reusable
            server.close()  # the server's FIN, before anything was written on the connection
            time.sleep(0.05)
            assert readable(client.fileno())
        finally:
            client.close()


@pytest.mark.skipif(not hasattr(__import__("socket"), "TCP_INFO"), reason="the kernel's TCP_INFO is Linux's")
async def test_a_pooled_connection_the_server_went_quiet_on_too_long_ago_is_not_reused(
        keepalive: KeepAliveUpstream, make_proxy: ProxyFactory, client: aiohttp.ClientSession,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's keep-alive timer runs from its last byte, which the kernel dates
    (tcpi_last_data_recv), not from when the pool took the connection back: on a busy loop, or
    behind a slow client, that release came seconds later, and a POST sent on it met the
    server's close (seen against vLLM: about 1 in 100 answers a 502)."""
    import proxy.relay.upstream.pool as upstream_client

    proxy = await make_proxy(keepalive.url)
    assert await post(client, proxy.proxy_url, "quiet-0") == (200, ANSWER)
    assert await post(client, proxy.proxy_url, "quiet-1") == (200, ANSWER)
    assert keepalive.connections == 1  # reused while the server spoke last a moment ago
    # The pool holds connections 3 s; here the server is taken to drop them after 0.2 s of
    # quiet. The pool's own clock (released 0.4 s ago) would hand the connection out again.
    monkeypatch.setattr(upstream_client, "POOLED_IDLE_S", 0.2)
    stale = proxy.forwarder.pool.stale_closed
    await asyncio.sleep(0.4)
    assert await post(client, proxy.proxy_url, "quiet-2") == (200, ANSWER)
    assert keepalive.connections == 2
    assert proxy.forwarder.pool.stale_closed == stale + 1


def test_the_kernel_dates_the_last_byte_a_connection_received() -> None:
    import socket

    from proxy.relay.upstream.connection import quiet_for

    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        try:
            server.send(b"x")
            time.sleep(0.3)
            quiet = quiet_for(client.fileno())
            assert quiet is not None and 0.25 <= quiet < 2.0
        finally:
            client.close()
            server.close()
