"""The proxy's own code failing on one exchange (a bug of ours, not the upstream's or the client's):
the client is never left waiting on it, the record says `proxy_error` with where it failed, one log
line says so without what the exchange carried, and the next request is served as ever.

Found by a load test of enforced deadlines: a failure after the answer's head went out let aiohttp
write its 500 into the middle of the relayed chunked body, and the client waited for an end that
never came."""

from __future__ import annotations

import asyncio
import contextlib
from typing import NoReturn

import aiohttp
import orjson
import pytest
from structlog.testing import capture_logs

from proxy.relay import body_pump, forward
from proxy.relay.body_pump import BodyPump
from proxy.relay.request_body import RequestBody
from tests.support.proxies import ProxyFactory, record_for
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.wire import openai_stream

CHAT = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "a secret prompt"}]}
pytestmark = pytest.mark.timeout(60)


class _FailingPump(BodyPump):
    """A pump that sends the answer's head, then fails as a bug of ours would."""

    def start(self) -> None:
        super().start()
        raise KeyError("what the exchange carried")


def _failing(*args: object, **kwargs: object) -> NoReturn:
    """A piece of the exchange's way that fails as a bug of ours would."""
    raise ValueError("what the exchange carried")


async def _post(url: str, request_id: str) -> tuple[int, bytes, str | None]:
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.post(
            url + "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": request_id}) as response:
        try:
            return response.status, await response.read(), None
        except aiohttp.ClientPayloadError as exc:
            return response.status, b"", type(exc).__name__


async def test_a_failure_after_the_head_breaks_the_connection_and_is_recorded(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    upstream.default = Script(chunks=openai_stream(5), delay=0.01)
    proxy = await make_proxy(upstream.url)
    monkeypatch.setattr(forward, "BodyPump", _FailingPump)
    with capture_logs() as logs:
        status, _, broke = await asyncio.wait_for(_post(proxy.proxy_url, "ours-after"), 10)
    assert status == 200 and broke == "ClientPayloadError"  # never a clean end, never a wait
    record = await record_for(proxy, "ours-after")
    assert record.stop_reason == "proxy_error" and record.cause == "proxy_error" and record.outcome == "cut"
    assert record.stop_detail is not None and "KeyError at test_own_failure.py:" in record.stop_detail
    failed = [line for line in logs if line["event"] == "exchange_failed"]
    assert len(failed) == 1 and failed[0]["error"] == "KeyError" and failed[0]["request_id"] == "ours-after"
    assert "what the exchange carried" not in repr(logs) and "secret" not in repr(logs)
    monkeypatch.undo()  # the next request, through the same proxy, as ever
    status, body, broke = await _post(proxy.proxy_url, "after-it")
    assert status == 200 and broke is None and body == b"".join(openai_stream(5))
    assert (await record_for(proxy, "after-it")).stop_reason == "eos"
    async with aiohttp.ClientSession() as session, session.get(proxy.admin_url + "/metrics") as response:
        metrics = await response.text()
    assert "\nllm_proxy_exchange_failures_total 1.0\n" in metrics  # (what LLMProxyExchangeFailures watches)


async def test_a_failure_before_the_request_went_upstream_is_a_json_502(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    upstream.default = Script(chunks=openai_stream(3))
    proxy = await make_proxy(upstream.url)
    monkeypatch.setattr(forward, "origin_target", _failing)
    with capture_logs() as logs:
        status, body, broke = await asyncio.wait_for(_post(proxy.proxy_url, "ours-before"), 10)
    assert status == 502 and broke is None
    error = orjson.loads(body)["error"]
    assert error["type"] == "proxy_error" and "ValueError" in error["message"]
    assert "what the exchange carried" not in body.decode()
    record = await record_for(proxy, "ours-before")
    assert record.stop_reason == "proxy_error" and record.status == 502
    assert [line["error"] for line in logs if line["event"] == "exchange_failed"] == ["ValueError"]
    assert not upstream.seen  # it never went


async def test_a_failure_while_the_head_is_made_ends_the_connection(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # Past this point aiohttp's writer belongs to the relayed answer: no answer of the proxy's own
    # can follow it cleanly, so the connection ends (the client is told at once, and not a 200).
    upstream.default = Script(chunks=openai_stream(3))
    proxy = await make_proxy(upstream.url)
    monkeypatch.setattr(forward, "response_head", _failing)
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await asyncio.wait_for(_post(proxy.proxy_url, "ours-head"), 10)
    record = await record_for(proxy, "ours-head")
    assert record.stop_reason == "proxy_error" and record.outcome == "cut"


async def test_a_client_gone_while_its_body_is_read_is_not_the_proxys_failure(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # (aiohttp usually cancels the handler when its client goes; where reading raises instead, the
    # record still says the client left, and no failure of the proxy's is logged.)
    proxy = await make_proxy(upstream.url)

    async def gone_mid_body(self: RequestBody, cap: int) -> None:
        raise ConnectionResetError("the client reset the connection")

    monkeypatch.setattr(RequestBody, "read", gone_mid_body)
    with capture_logs() as logs, contextlib.suppress(aiohttp.ClientError):
        await asyncio.wait_for(_post(proxy.proxy_url, "gone-mid-body"), 10)
    record = await record_for(proxy, "gone-mid-body")
    assert record.stop_reason == "client_disconnect" and record.client_disconnected
    assert not [line for line in logs if line["event"] == "exchange_failed"] and not upstream.seen


async def test_a_failure_in_the_read_callback_is_the_proxys_not_the_upstreams(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # The pump runs in the upstream connection's read callback: a failure there, raised to asyncio,
    # dropped the upstream connection and the record said upstream_disconnect, a guess against the
    # server. It stops the pump instead, and the exchange ends as the proxy's own failure.
    upstream.default = Script(chunks=openai_stream(8), delay=0.01)
    proxy = await make_proxy(upstream.url)
    reads = [0]
    real = body_pump.chunk_start

    def failing_on_the_fourth(data: bytes) -> int:
        reads[0] += 1
        if reads[0] == 4:
            raise IndexError("what the exchange carried")
        return real(data)

    monkeypatch.setattr(body_pump, "chunk_start", failing_on_the_fourth)
    with capture_logs() as logs:
        status, _, broke = await asyncio.wait_for(_post(proxy.proxy_url, "ours-in-a-read"), 10)
    assert status == 200 and broke == "ClientPayloadError"
    record = await record_for(proxy, "ours-in-a-read")
    assert record.stop_reason == "proxy_error" and "IndexError at test_own_failure.py:" in (record.stop_detail or "")
    assert [line["error"] for line in logs if line["event"] == "exchange_failed"] == ["IndexError"]
    assert not [line for line in logs if "Fatal error" in str(line.get("event"))]
