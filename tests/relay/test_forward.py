"""The exchange driven with bytes and no socket on either side (as httpcore's connection tests do):
the client's request comes from aiohttp's mocked request over a mock transport, the upstream's
answer is fed to a real upstream connection over another. What the relay must do whatever the
diagnosis does: the bytes reach the client as they came, the request reaches the upstream with the
proxy's request id, and the diagnosis hears of the exchange exactly twice, at its start and at its
end, whatever way it ended."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.http import StreamWriter
from aiohttp.streams import StreamReader
from aiohttp.test_utils import make_mocked_request

from proxy.config import ProxyConfig
from proxy.diagnosis.recorder import Recorder
from proxy.record import ResponseRecord
from proxy.relay.forward import Forwarder, RelayedResponse
from proxy.relay.in_flight import InFlightTracker
from proxy.relay.upstream.connection import Connection, ConnectionState, UpstreamUnreachable
from proxy.wire.parse_bytes import ParseBytes
from tests.support.mock_transport import MockTransport
from tests.support.wire import openai_stream

CHAT = orjson.dumps({"model": "m", "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


class Ends:
    """The diagnosis's side, as the relay sees it: the calls it makes."""

    def __init__(self) -> None:
        self.started: list[ResponseRecord] = []
        self.records: list[ResponseRecord] = []
        self.authorization: list[str | None] = []

    def started_(self, record: ResponseRecord) -> None:
        self.started.append(record)

    def ended(self, recorder: Recorder, authorization: str | None) -> None:
        self.records.append(recorder.finish())
        self.authorization.append(authorization)


class Client:
    """The client's side: its connection's transport, and what the relay wrote to it."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.transport = MockTransport()

        async def drained() -> None:
            return None

        self.protocol = SimpleNamespace(transport=self.transport, writing_paused=False, ssl_context=None,
                                        peername=("127.0.0.1", 50000), sockname=("127.0.0.1", 8080),
                                        max_field_size=8190, max_line_length=8190, max_headers=128,
                                        _drain_helper=drained, _paused=False,
                                        resume_reading=lambda resume_parser=True: None, pause_reading=lambda: None)
        self.writer = StreamWriter(self.protocol, loop)  # type: ignore[arg-type]

    def request(self, body: bytes = CHAT, headers: dict[str, str] | None = None, closing: bool = False) -> Any:
        payload = StreamReader(self.protocol, 1 << 16, loop=asyncio.get_running_loop())  # type: ignore[arg-type]
        payload.feed_data(body)
        payload.feed_eof()
        return make_mocked_request("POST", "/v1/chat/completions", writer=self.writer, protocol=self.protocol,
                                   transport=self.transport, payload=payload, closing=closing,
                                   headers={"Content-Type": "application/json", "Content-Length": str(len(body)),
                                            **(headers or {})})

    @property
    def body(self) -> bytes:
        """What reached the client after the head (the body as it was framed)."""
        return bytes(self.transport.written).partition(b"\r\n\r\n")[2]


def relay(connection_for: Callable[[], Any]) -> tuple[Forwarder, Ends]:
    ends = Ends()
    finisher: Any = SimpleNamespace(started=ends.started_, ended=ends.ended)
    forwarder = Forwarder(ProxyConfig(upstream="http://upstream:8000"), finisher, InFlightTracker(),
                          ParseBytes(1 << 20))
    forwarder.pool._connection = connection_for  # type: ignore[method-assign]
    return forwarder, ends


def upstream_connection() -> tuple[Connection, MockTransport]:
    connection = Connection(asyncio.get_running_loop())
    transport = MockTransport()
    transport.set_protocol(connection)
    connection.connection_made(transport)
    return connection, transport


async def until(check: Callable[[], bool]) -> None:
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0)
    raise AssertionError("never")


@pytest.fixture
async def exchange() -> Any:
    connection, transport = upstream_connection()

    async def pooled() -> tuple[Connection, bool]:
        return connection, False

    forwarder, ends = relay(pooled)
    return SimpleNamespace(forwarder=forwarder, ends=ends, upstream=connection, upstream_transport=transport,
                           client=Client())


async def test_a_stream_reaches_the_client_read_by_read_and_the_diagnosis_hears_start_and_end(exchange: Any) -> None:
    handled = asyncio.ensure_future(exchange.forwarder.handle(exchange.client.request(headers={
        "Authorization": "Bearer client-key"})))
    await until(lambda: b"\r\n\r\n" in exchange.upstream_transport.written)
    sent = bytes(exchange.upstream_transport.written)
    assert sent.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n") and sent.endswith(CHAT)
    record_id = exchange.ends.started[0].request_id
    assert f"X-Request-Id: {record_id}".encode() in sent
    chunks = [b"%x\r\n%s\r\n" % (len(event), event) for event in openai_stream(3)] + [b"0\r\n\r\n"]
    exchange.upstream.data_received(SSE_HEAD)
    for chunk in chunks:
        exchange.upstream.data_received(chunk)
    response = await asyncio.wait_for(handled, 2)
    assert response.status == 200
    assert exchange.client.body == b"".join(chunks)  # the chunks as they came, the last one too
    head = bytes(exchange.client.transport.written).partition(b"\r\n\r\n")[0]
    assert f"X-Request-Id: {record_id}".encode() in head and b"X-LLM-Diag-Concurrency: 1" in head
    assert len(exchange.ends.started) == 1 and len(exchange.ends.records) == 1
    (record,) = exchange.ends.records
    assert (record.stop_reason, record.output_tokens, record.status) == ("eos", 3, 200)
    assert exchange.ends.authorization == ["Bearer client-key"]  # for the server's tokenizer, where asked
    assert exchange.upstream.state is ConnectionState.IDLE  # its answer ended: back in the pool


async def test_the_head_and_the_first_event_that_came_with_it_reach_the_client_in_one_write(exchange: Any) -> None:
    """One write, not two: the client hears of the answer with its first token, as the server sent them."""
    handled = asyncio.ensure_future(exchange.forwarder.handle(exchange.client.request()))
    await until(lambda: exchange.upstream_transport.written.endswith(CHAT))
    first, *rest = [b"%x\r\n%s\r\n" % (len(event), event) for event in openai_stream(2)] + [b"0\r\n\r\n"]
    exchange.upstream.data_received(SSE_HEAD + first)
    await until(lambda: bool(exchange.client.transport.writes))
    (written,) = exchange.client.transport.writes
    assert written.startswith(b"HTTP/1.1 200 OK\r\n") and written.endswith(b"\r\n\r\n" + first)
    for chunk in rest:
        exchange.upstream.data_received(chunk)
    await asyncio.wait_for(handled, 2)
    assert exchange.client.body == first + b"".join(rest)


async def test_a_head_that_comes_alone_reaches_the_client_before_any_token(exchange: Any) -> None:
    handled = asyncio.ensure_future(exchange.forwarder.handle(exchange.client.request()))
    await until(lambda: exchange.upstream_transport.written.endswith(CHAT))
    exchange.upstream.data_received(SSE_HEAD)  # the server thinks before its first token
    await until(lambda: bool(exchange.client.transport.writes))
    assert exchange.client.transport.writes[0].endswith(b"Transfer-Encoding: chunked\r\n\r\n")
    exchange.upstream.data_received(b"0\r\n\r\n")
    await asyncio.wait_for(handled, 2)


async def test_a_header_value_that_is_not_utf8_reaches_a_streams_client_as_it_came(exchange: Any) -> None:
    """aiohttp's own head writer drops such a byte (`caf\\xe9` went out as `caf`); the relay's head
    passes the upstream's bytes on."""
    handled = asyncio.ensure_future(exchange.forwarder.handle(exchange.client.request()))
    await until(lambda: exchange.upstream_transport.written.endswith(CHAT))
    exchange.upstream.data_received(SSE_HEAD.replace(b"\r\n\r\n", b"\r\nX-Note: caf\xe9\r\n\r\n") + b"0\r\n\r\n")
    await asyncio.wait_for(handled, 2)
    assert b"\r\nX-Note: caf\xe9\r\n" in exchange.client.transport.writes[0]


@pytest.mark.parametrize("closing", [False, True])
@pytest.mark.parametrize("upstream_headers", [
    {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
    {"Server": "vllm", "Date": "Sun, 06 Dec 2026 20:00:00 GMT", "Content-Type": "application/x-ndjson",
     "X-Request-Id": "theirs", "Trailer": "X-Checksum", "X-Note": "caf\u00e9"},
    {},
])
async def test_the_relayed_head_is_the_one_aiohttps_prepare_writes(closing: bool,
                                                                   upstream_headers: dict[str, str]) -> None:
    """`RelayedResponse.start_chunked` against aiohttp's own `prepare` for the same answer: the same
    bytes, and a response aiohttp then takes as prepared (its writer chunks, its end ends it)."""
    heads = []
    for direct in (False, True):
        client = Client()
        request = client.request(headers={"Connection": "close"} if closing else {}, closing=closing)
        response = RelayedResponse(status=200, reason="OK", headers=upstream_headers)
        response.added = frozenset(name for name in ("Content-Type", "Date", "Server") if name not in upstream_headers)
        response.headers["X-LLM-Diag-Concurrency"] = "3"
        if direct:
            head = response.start_chunked(request, client.writer)
            assert await response.prepare(request) is client.writer and client.transport.writes == []
        else:
            await response.prepare(request)
            (head,) = client.transport.writes
        assert client.writer.chunked and response.keep_alive is not closing
        await response.write(b"x")
        await response.write_eof()
        heads.append((head, client.transport.writes[-2:]))
    assert heads[0] == heads[1]


async def test_a_body_of_known_length_is_relayed_whole(exchange: Any) -> None:
    handled = asyncio.ensure_future(exchange.forwarder.handle(exchange.client.request()))
    await until(lambda: exchange.upstream_transport.written.endswith(CHAT))
    answer = orjson.dumps({"id": "c", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 8}})
    exchange.upstream.data_received(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                                    % len(answer) + answer)
    await asyncio.wait_for(handled, 2)
    assert exchange.client.body == answer
    (record,) = exchange.ends.records
    assert (record.stop_reason, record.length_cause, record.output_tokens) == ("length", "requested_budget", 8)


async def test_a_header_value_that_is_not_utf8_reaches_the_client_of_a_body_of_known_length_as_it_came(
        exchange: Any) -> None:
    """The answers `start_chunked` does not take go through aiohttp's `prepare`, whose serializer
    drops such a byte: the relay's `_write_headers` passes it on there too."""
    handled = asyncio.ensure_future(exchange.forwarder.handle(exchange.client.request()))
    await until(lambda: exchange.upstream_transport.written.endswith(CHAT))
    exchange.upstream.data_received(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Note: caf\xe9\r\n"
                                    b"Content-Length: 2\r\n\r\n{}")
    await asyncio.wait_for(handled, 2)
    head, _, body = bytes(exchange.client.transport.written).partition(b"\r\n\r\n")
    assert b"\r\nX-Note: caf\xe9\r\n" in head + b"\r\n" and body == b"{}"


@pytest.mark.parametrize("closing", [False, True])
async def test_the_head_of_a_body_of_known_length_is_the_one_aiohttp_writes(closing: bool) -> None:
    """Where every value is UTF-8, `RelayedResponse._write_headers` writes aiohttp's own bytes."""
    heads = []
    for response in (RelayedResponse(status=201, reason="Created", headers={"X-Note": "caf\u00e9", "A": "b"}),
                     web.StreamResponse(status=201, reason="Created", headers={"X-Note": "caf\u00e9", "A": "b"})):
        client = Client()
        request = client.request(headers={"Connection": "close"} if closing else {}, closing=closing)
        response.content_length = 2
        await response.prepare(request)
        await response.write(b"{}")
        await response.write_eof()
        heads.append(bytes(client.transport.written))
    assert heads[0] == heads[1] and heads[0].endswith(b"\r\n\r\n{}")


async def test_an_upstream_that_breaks_mid_stream_breaks_the_clients_connection_and_is_recorded(
        exchange: Any) -> None:
    handled = asyncio.ensure_future(exchange.forwarder.handle(exchange.client.request()))
    await until(lambda: exchange.upstream_transport.written.endswith(CHAT))
    exchange.upstream.data_received(SSE_HEAD)
    first = openai_stream(3)[1]
    exchange.upstream.data_received(b"%x\r\n%s\r\n" % (len(first), first))
    await until(lambda: first in exchange.client.transport.written)
    exchange.upstream.connection_lost(ConnectionResetError("reset by peer"))
    await asyncio.wait_for(handled, 2)
    assert exchange.client.transport.closed  # no clean end: the client sees the break, as it happened
    (record,) = exchange.ends.records
    assert record.stop_reason == "upstream_disconnect" and record.upstream_error == "reset"
    assert exchange.upstream.state is ConnectionState.CLOSED


async def test_a_client_that_leaves_mid_stream_is_recorded_and_the_upstream_let_go(exchange: Any) -> None:
    handled = asyncio.ensure_future(exchange.forwarder.handle(exchange.client.request()))
    await until(lambda: exchange.upstream_transport.written.endswith(CHAT))
    exchange.upstream.data_received(SSE_HEAD)
    first = openai_stream(3)[1]
    exchange.upstream.data_received(b"%x\r\n%s\r\n" % (len(first), first))
    await until(lambda: first in exchange.client.transport.written)
    exchange.client.transport.closed = True  # the client's connection went away
    exchange.upstream.data_received(b"%x\r\n%s\r\n" % (len(first), first))
    await asyncio.wait_for(handled, 2)
    (record,) = exchange.ends.records
    assert record.client_disconnected and record.stop_reason == "client_disconnect"
    assert exchange.upstream.state is not ConnectionState.IDLE  # not given back mid-answer


async def test_a_client_that_leaves_before_the_head_is_a_routine_end_not_a_handler_error(exchange: Any) -> None:
    """The head cannot be written to a client already gone: recorded as it left, the handler
    returns (aiohttp would log a raised ConnectionError as an error handling the request)."""
    handled = asyncio.ensure_future(exchange.forwarder.handle(exchange.client.request()))
    await until(lambda: exchange.upstream_transport.written.endswith(CHAT))
    exchange.client.transport.closed = True  # gone while the server thought
    exchange.upstream.data_received(SSE_HEAD)
    response = await asyncio.wait_for(handled, 2)  # (no exception out of the handler)
    assert response.status == 200 and exchange.client.transport.written == b""
    (record,) = exchange.ends.records
    assert record.client_disconnected and record.stop_reason == "client_disconnect"
    assert record.disconnect_phase == "before_first_token"
    assert exchange.upstream.state is ConnectionState.CLOSED  # the server sees the disconnect


async def test_an_upstream_that_cannot_be_reached_is_a_502_and_still_one_record() -> None:
    async def unreachable() -> tuple[Connection, bool]:
        raise UpstreamUnreachable(ConnectionRefusedError(111, "Connection refused"))

    forwarder, ends = relay(unreachable)
    client = Client()
    response = await forwarder.handle(client.request())
    assert response.status == 502
    assert orjson.loads(response.body)["error"]["type"] == "upstream_unavailable"  # type: ignore[arg-type]
    assert len(ends.started) == 1 and len(ends.records) == 1
    assert ends.records[0].upstream_error == "connect"


async def test_the_request_is_upstream_before_the_record_reads_its_body(exchange: Any) -> None:
    """The server works on the request while the record reads what it asks for: the diagnosis
    is not on the way to the first token."""
    upstream_had: list[bytes] = []
    original = Recorder.request_body

    def reading(recorder: Recorder, body: Any, note: str | None = None) -> None:
        upstream_had.append(bytes(exchange.upstream_transport.written))
        original(recorder, body, note)

    Recorder.request_body = reading  # type: ignore[method-assign]
    try:
        handled = asyncio.ensure_future(exchange.forwarder.handle(exchange.client.request()))
        await until(lambda: bool(exchange.ends.started))
        assert upstream_had and upstream_had[0].endswith(CHAT)  # sent whole, then read
        assert exchange.ends.started[0].model == "m"  # and the start told with the model it asks for
        exchange.upstream.data_received(SSE_HEAD + b"0\r\n\r\n")
        await asyncio.wait_for(handled, 2)
    finally:
        Recorder.request_body = original  # type: ignore[method-assign]
    assert len(upstream_had) == 1 and exchange.ends.records[0].requested_max_tokens == 8


async def test_the_record_is_made_once_the_request_is_upstream_and_reads_the_answer_once_it_reached_the_client(
        exchange: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first token's way carries only what it needs: the record (its start, the client's name,
    the trace context) is made while the server works on the request, and the answer is read for
    it once its head and first event went out to the client."""
    upstream_had: list[bytes] = []
    client_had: list[list[bytes]] = []
    start, read_head = Recorder.start.__func__, Recorder.response_head  # type: ignore[attr-defined]

    def starting(cls: type[Recorder], *args: Any, **kwargs: Any) -> Recorder:
        upstream_had.append(bytes(exchange.upstream_transport.written))
        return start(cls, *args, **kwargs)  # type: ignore[no-any-return]

    def reading(recorder: Recorder, *args: Any) -> None:
        client_had.append(list(exchange.client.transport.writes))
        read_head(recorder, *args)

    monkeypatch.setattr(Recorder, "start", classmethod(starting))
    monkeypatch.setattr(Recorder, "response_head", reading)
    handled = asyncio.ensure_future(exchange.forwarder.handle(exchange.client.request(headers={
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})))
    await until(lambda: bool(exchange.ends.started))
    assert len(upstream_had) == 1 and upstream_had[0].endswith(CHAT)  # sent whole, then the record made
    first, *rest = [b"%x\r\n%s\r\n" % (len(event), event) for event in openai_stream(2)] + [b"0\r\n\r\n"]
    exchange.upstream.data_received(SSE_HEAD + first)
    await until(lambda: bool(exchange.client.transport.writes))
    for chunk in rest:
        exchange.upstream.data_received(chunk)
    await asyncio.wait_for(handled, 2)
    assert len(client_had) == 1 and client_had[0] == exchange.client.transport.writes[:1]
    assert client_had[0][0].endswith(b"\r\n\r\n" + first)  # out first, then read
    (record,) = exchange.ends.records
    assert (record.status, record.stop_reason, record.output_tokens) == (200, "eos", 2)
    assert (record.trace_id, record.concurrency_at_start) == ("0af7651916cd43dd8448eb211c80319c", 1)
    assert f"X-Request-Id: {record.request_id}".encode() in upstream_had[0]


async def test_an_answer_without_a_byte_of_body_is_still_read_for_the_record(exchange: Any) -> None:
    handled = asyncio.ensure_future(exchange.forwarder.handle(exchange.client.request()))
    await until(lambda: bool(exchange.ends.started))
    exchange.upstream.data_received(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n")
    response = await asyncio.wait_for(handled, 2)
    assert response.status == 500
    (record,) = exchange.ends.records
    assert (record.status, record.stop_reason) == (500, "upstream_error")


async def test_a_request_that_never_went_upstream_still_names_what_it_asked() -> None:
    async def unreachable() -> tuple[Connection, bool]:
        raise UpstreamUnreachable(ConnectionRefusedError(111, "Connection refused"))

    forwarder, ends = relay(unreachable)
    forwarder.refuse_new()  # shutting down: the send is never tried
    response = await forwarder.handle(Client().request())
    assert response.status == 503
    (record,) = ends.records
    assert (record.model, record.requested_max_tokens, record.stream) == ("m", 8, True)
    assert ends.started[0] is record


async def test_a_pooled_connection_says_its_state_to_its_pool() -> None:
    connection, _ = upstream_connection()
    assert connection.state is ConnectionState.TAKEN  # a new one is opened for a request
    connection.expect_answer(head=False)
    assert connection.state is ConnectionState.ACTIVE
    connection.released(0.0)
    assert connection.state is ConnectionState.IDLE
    connection.taken()
    assert connection.state is ConnectionState.TAKEN and not connection.is_available(1.0, 3.0)
    connection.close()
    assert connection.state is ConnectionState.CLOSED and not connection.can_carry_another
