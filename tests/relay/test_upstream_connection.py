"""The upstream connection driven with bytes and no server: it parses answers as they come, keeps
what the relay needs of them, and answers the pool's questions from its own state."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiohttp.client_exceptions import ClientOSError
from aiohttp.streams import StreamReader

from proxy.relay.upstream import connection as connection_module
from proxy.relay.upstream.connection import SETTLE_S, Connection
from tests.support.mock_transport import MockTransport


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair()
    yield ours, theirs
    ours.close()
    theirs.close()


def connected(sock: socket.socket | None = None) -> tuple[Connection, MockTransport]:
    connection = Connection(asyncio.get_running_loop())
    transport = MockTransport(sock)
    transport.set_protocol(connection)
    connection.connection_made(transport)
    return connection, transport


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


async def answered(connection: Connection, head: bytes = CHUNKED_HEAD) -> StreamReader:
    """The connection's next answer begun with `head`: its body reader."""
    connection.expect_answer(head=False)
    connection.data_received(head)
    _, payload = await connection.read()
    return payload


def taken(connection: Connection) -> list[tuple[bytes, bool]]:
    """What the connection hands the relay from now on: each read, and the loss."""
    reads: list[tuple[bytes, bool]] = []
    connection.take_body(lambda data, lost=False: reads.append((data, lost)))
    return reads


async def test_an_answer_fed_in_pieces_is_parsed_and_its_bytes_counted() -> None:
    connection, _ = connected()
    connection.expect_answer(head=False)
    connection.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Request-Id: up-1\r\n\r\nhel")
    connection.data_received(b"")  # aiohttp's nudge to resume a paused read: no bytes came
    connection.data_received(b"lo")
    message, payload = await connection.read()
    assert (message.code, message.headers["X-Request-Id"]) == (200, "up-1")
    assert await payload.read() == b"hello"
    assert connection.received == len(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Request-Id: up-1\r\n\r\nhello")


async def test_a_chunked_body_is_held_past_the_parser_and_handed_over_as_it_came() -> None:
    """The head is parsed alone; the chunked body after it, framing and trailers included, waits
    for the relay and then goes to it read by read, unparsed."""
    connection, _ = connected()
    connection.expect_answer(head=False)
    connection.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Sum\r\n\r\n5\r\nhello\r\n")
    message, payload = await connection.read()
    assert message.chunked and connection.raw_body and payload.total_bytes == 0
    connection.data_received(b"0\r\nX-Sum: 42\r\n\r\n")
    reads = taken(connection)
    connection.data_received(b"more")
    assert reads == [(b"5\r\nhello\r\n0\r\nX-Sum: 42\r\n\r\n", False), (b"more", False)]
    connection.body_read_whole(extra=True)
    assert payload.is_eof() and connection.should_close and not connection.raw_body


async def test_while_a_body_is_taken_the_transport_reads_straight_into_the_taker() -> None:
    """The loop calls the taker itself per read (no call through the connection); losing the
    connection still reaches it, and once the body ended the connection reads again."""
    connection, transport = connected()
    await answered(connection)
    reads = taken(connection)
    taking = transport.get_protocol()
    assert taking is not connection
    taking.data_received(b"3\r\nabc\r\n")
    taking.pause_writing()  # the request's flow control stays the connection's
    assert connection.writing_paused
    taking.resume_writing()
    connection.body_read_whole(extra=False)
    assert transport.get_protocol() is connection and reads == [(b"3\r\nabc\r\n", False)]
    await answered(connection)
    reads = taken(connection)
    transport.get_protocol().connection_lost(None)
    assert reads[-1] == (b"", True)


async def test_an_interim_answer_is_parsed_and_the_final_heads_body_held() -> None:
    connection, _ = connected()
    connection.expect_answer(head=False)
    connection.data_received(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r")
    connection.data_received(b"\n3\r\nabc\r\n")
    interim, _ = await connection.read()
    final, _ = await connection.read()
    assert (interim.code, final.code, connection.raw_body) == (100, 200, True)
    reads = taken(connection)
    assert reads == [(b"3\r\nabc\r\n", False)]


async def test_a_body_with_a_length_goes_through_the_parser() -> None:
    connection, _ = connected()
    connection.expect_answer(head=False)
    connection.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel")
    connection.data_received(b"lo")
    _, payload = await connection.read()
    assert not connection.raw_body and await payload.read() == b"hello"


async def test_an_answer_to_head_has_no_body_whatever_its_length_says() -> None:
    connection, _ = connected()
    connection.expect_answer(head=True)
    connection.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")
    message, payload = await connection.read()
    assert message.code == 200 and await payload.read() == b""


async def test_the_next_answer_starts_the_count_again() -> None:
    connection, _ = connected()
    connection.expect_answer(head=False)
    connection.data_received(b"HTTP/1.1 204 No Content\r\n\r\n")
    await connection.read()
    connection.expect_answer(head=False)
    assert (connection.received, connection.raw_tail(), connection.streamed) == (0, b"", False)


async def test_a_connection_that_carried_a_stream_rests_before_it_is_available(
        pair: tuple[socket.socket, socket.socket]) -> None:
    connection, _ = connected(pair[0])
    connection.streamed = True
    connection.released(100.0)
    assert not connection.is_settled(100.0) and not connection.is_available(100.0, 3.0)
    assert connection.is_settled(100.0 + SETTLE_S) and connection.is_available(100.0 + SETTLE_S, 3.0)
    connection.streamed = False
    connection.released(200.0)  # an answer with a length: available at once
    assert connection.is_available(200.0, 3.0)


async def test_a_stream_whose_end_was_parsed_before_its_head_was_read_still_rests(
        pair: tuple[socket.socket, socket.socket]) -> None:
    connection, _ = connected(pair[0])
    connection.released(100.0)  # a short stream: its end parsed, the connection back in the pool...
    connection.streamed = True  # ...before the relay read the head and said it was a stream
    assert not connection.is_available(100.1, 3.0) and connection.is_available(100.0 + SETTLE_S, 3.0)


async def test_a_connection_the_server_closed_is_not_available(pair: tuple[socket.socket, socket.socket]) -> None:
    connection, _ = connected(pair[0])
    connection.released(10.0)
    assert connection.is_available(10.0, 3.0)
    pair[1].close()  # the server's FIN while the connection idles in the pool
    assert not connection.is_available(10.0, 3.0)


async def test_bytes_that_belong_to_no_request_make_a_connection_unavailable(
        pair: tuple[socket.socket, socket.socket]) -> None:
    connection, _ = connected(pair[0])
    connection.released(10.0)
    pair[1].send(b"HTTP/1.1 200 OK\r\n")
    assert not connection.is_available(10.0, 3.0)


async def test_a_connection_expires_past_the_idle_time_or_once_closed(
        pair: tuple[socket.socket, socket.socket]) -> None:
    connection, transport = connected(pair[0])
    connection.released(50.0)
    assert not connection.has_expired(53.0, 3.0) and connection.has_expired(53.1, 3.0)
    assert not connection.is_available(53.1, 3.0)
    transport.close()
    assert connection.has_expired(50.0, 3.0)


async def test_a_body_without_a_length_goes_chunked_and_ends_with_the_last_chunk() -> None:
    connection, transport = connected()

    async def pieces() -> AsyncIterator[bytes]:
        for piece in (b'{"model":', b"", b'"m"}'):
            yield piece

    await connection.send_body(pieces(), chunked=True)
    assert bytes(transport.written) == b'9\r\n{"model":\r\n4\r\n"m"}\r\n0\r\n\r\n'


async def test_a_body_that_breaks_off_fails_the_exchange_and_closes_the_connection() -> None:
    connection, transport = connected()
    connection.expect_answer(head=False)

    async def pieces() -> AsyncIterator[bytes]:
        yield b"part"
        raise ConnectionResetError("the client went away")

    answer = asyncio.ensure_future(connection.read())  # the pool waits for the answer as the body goes
    await asyncio.sleep(0)
    await connection.send_body(pieces(), chunked=False)
    assert bytes(transport.written) == b"part" and transport.closed
    with pytest.raises(ClientOSError, match="could not be sent on"):
        await answer


@pytest.fixture
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """Two ends of a loopback TCP connection: the kernel keeps its clock of the last data received."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ours = socket.create_connection(listener.getsockname())
        theirs, _ = listener.accept()
    yield ours, theirs
    ours.close()
    theirs.close()


async def test_the_kernels_clock_is_read_when_a_connection_comes_back_and_not_when_it_is_taken(
        tcp_pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    """The taking is on the way to a first token: it makes one poll(2), not the clock's syscalls."""
    read: list[float | None] = []
    real = connection_module.quiet_for

    def quiet_for(sock: object) -> float | None:
        read.append(real(sock))
        return read[-1]

    monkeypatch.setattr(connection_module, "quiet_for", quiet_for)
    ours, theirs = tcp_pair
    theirs.sendall(b"HTTP/1.1 204 No Content\r\n\r\n")  # the server's last bytes, received by the kernel
    ours.recv(64)
    connection, _ = connected(ours)
    connection.released(10.0)
    assert len(read) == 1 and read[0] is not None and 0.0 <= read[0] < 1.0
    assert connection.is_available(10.0, 3.0) and connection.is_available(10.5, 3.0)
    assert len(read) == 1


async def test_a_server_quiet_long_before_the_release_by_the_kernels_clock_makes_the_connection_unavailable(
        pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    """The answer's end was read late (a slow client held the upstream back): the server's keep-alive
    timer runs from its last byte, 2.9 s before the pool's clock began."""
    monkeypatch.setattr(connection_module, "quiet_for", lambda sock: 2.9)
    connection, _ = connected(pair[0])
    connection.released(10.0)
    assert connection.is_available(10.05, 3.0)
    assert not connection.is_available(10.2, 3.0) and not connection.has_expired(10.2, 3.0)


def test_the_kernels_clock_is_read_through_libc_on_the_descriptor_and_leaves_it_open(
        tcp_pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    """libc's getsockopt(2) on the descriptor, no socket object made: the figure the socket's own
    call gives, and where libc could not be loaded the socket's own call, detached after it."""
    ours, theirs = tcp_pair
    theirs.sendall(b"x")
    ours.recv(1)
    time.sleep(0.05)
    assert connection_module._getsockopt is not None  # (Linux: what the relay uses)
    through_libc = connection_module.quiet_for(ours.fileno())
    raw = ours.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 56)
    by_socket = struct.unpack_from("=I", raw, 52)[0] / 1000.0
    assert through_libc is not None and 0.04 <= through_libc < 1.0
    assert abs(through_libc - by_socket) < 0.02
    monkeypatch.setattr(connection_module, "_getsockopt", None)
    fallback = connection_module.quiet_for(ours.fileno())
    assert fallback is not None and abs(fallback - through_libc) < 0.02
    theirs.sendall(b"y")  # the descriptor is still ours, open, after both readings
    assert ours.recv(1) == b"y"


@pytest.mark.parametrize("libc", [True, False])
def test_no_clock_where_the_descriptor_is_no_tcp_socket(libc: bool, monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    if not libc:
        monkeypatch.setattr(connection_module, "_getsockopt", None)
    with (tmp_path / "f").open("wb") as file:
        assert connection_module.quiet_for(file.fileno()) is None
    assert connection_module.quiet_for(-1) is None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
        assert connection_module.quiet_for(unix.fileno()) is None
