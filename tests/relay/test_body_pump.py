"""The pump driven with bytes: a chunked body's reads go to the client as they came and their
payloads to the record; a client that takes no more pauses the upstream, and resumes it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest

from proxy.relay import body_pump
from proxy.relay.body_pump import BodyPump, Stop
from proxy.relay.deadlines import Deadlines
from proxy.relay.upstream.connection import Connection
from tests.relay.test_upstream_connection import answered, connected
from tests.support.mock_transport import MockTransport


class FullTransport(MockTransport):
    """A client's transport that holds what it was given: its buffer is never empty."""

    def get_write_buffer_size(self) -> int:
        return len(self.written)


async def pumping(client_paused: bool) -> tuple[BodyPump, Connection, MockTransport, MockTransport, list[bytes]]:
    connection, upstream = connected()
    payload = await answered(connection)
    to_client = FullTransport()
    client = SimpleNamespace(transport=to_client, writing_paused=client_paused)
    fed: list[bytes] = []
    pump = BodyPump(payload, connection, client, True, lambda data, now: fed.append(data),  # type: ignore[arg-type]
                    Deadlines(time.monotonic(), 0, 0, False), time.monotonic())
    pump.start()
    return pump, connection, upstream, to_client, fed


async def test_reads_of_one_chunk_each_go_on_as_they_came_and_the_end_ends_the_pump() -> None:
    pump, connection, upstream, to_client, fed = await pumping(client_paused=False)
    reads = [b"5\r\nhello\r\n", b"1\r\n \r\n", b"3\r\nabc\r\n2\r\nde\r\n", b"0\r\n\r\n"]
    for read in reads:
        upstream.get_protocol().data_received(read)  # the loop calls the pump itself
    assert bytes(to_client.written) == b"".join(reads)
    assert fed == [b"hello", b" ", b"abcde"] and pump.stopped is Stop.END
    assert upstream.get_protocol() is connection


async def test_a_read_of_one_chunk_the_client_cannot_take_pauses_the_upstream_until_resumed() -> None:
    pump, _, upstream, to_client, fed = await pumping(client_paused=True)
    upstream.get_protocol().data_received(b"5\r\nhello\r\n")
    assert (pump.stopped, upstream.reading) == (Stop.PAUSED, False)
    assert bytes(to_client.written) == b"5\r\nhello\r\n" and fed == [b"hello"]
    pump._client.writing_paused = False  # type: ignore[attr-defined]  # drained
    pump.resume()
    assert (pump.stopped, upstream.reading) == (None, True)
    upstream.get_protocol().data_received(b"2\r\nok\r\n0\r\n\r\n")
    assert fed == [b"hello", b"ok"] and pump.stopped is Stop.END


async def laned(times: list[float] | None = None) -> tuple[BodyPump, Connection, MockTransport, MockTransport,
                                                           list[tuple[bytes, float]]]:
    """A pump whose record keeps each payload with its time (`times`: the clock the reads meet)."""
    connection, upstream = connected()
    payload = await answered(connection)
    to_client = MockTransport()
    client = SimpleNamespace(transport=to_client, writing_paused=False)
    fed: list[tuple[bytes, float]] = []
    pump = BodyPump(payload, connection, client, True, lambda data, now: fed.append((data, now)),  # type: ignore[arg-type]
                    Deadlines(0.0, 0, 0, False), 0.0)
    if times is not None:
        clock = iter(times)
        body_pump.time = SimpleNamespace(monotonic=lambda: next(clock))  # type: ignore[attr-defined]
    pump.start()
    return pump, connection, upstream, to_client, fed


@pytest.fixture(autouse=True)
def _real_clock() -> Iterator[None]:
    yield
    body_pump.time = time  # type: ignore[attr-defined]


async def test_reads_the_lane_keeps_reach_the_record_in_order_with_their_own_times() -> None:
    reads = [b"5\r\nhello\r\n", b"1\r\n \r\n", b"3\r\nabc\r\n2\r\nde\r\n", b"2\r\nfg\r\n", b"0\r\n\r\n"]
    pump, _, upstream, to_client, fed = await laned([1.0, 1.5, 4.0, 4.25, 6.0])
    for read in reads[:2]:
        upstream.get_protocol().data_received(read)
    assert fed == [] and bytes(to_client.written) == b"".join(reads[:2])  # written at once, recorded later
    for read in reads[2:]:
        upstream.get_protocol().data_received(read)
    assert fed == [(b"hello", 1.0), (b" ", 1.5), (b"abcde", 4.0), (b"fg", 4.25)]
    assert bytes(to_client.written) == b"".join(reads) and pump.stopped is Stop.END
    assert (pump.last, pump.max_gap, pump.ended_at) == (6.0, 2.5, 6.0)


async def test_the_lane_hands_on_a_run_of_reads_and_whatever_it_keeps_when_the_pump_is_detached() -> None:
    pump, _, upstream, _, fed = await laned()
    for number in range(body_pump.LANE_READS + 3):
        upstream.get_protocol().data_received(b"1\r\n%d\r\n" % (number % 10))
    assert len(fed) == body_pump.LANE_READS  # one run handed on, three reads kept
    pump.detach()
    assert [data for data, _ in fed] == [b"%d" % (number % 10) for number in range(body_pump.LANE_READS + 3)]


async def test_the_lane_hands_the_record_its_reads_in_their_framing_with_their_payloads_size() -> None:
    """No copy of each payload: the record gets each read as it came, where its payload is in it."""
    connection, upstream = connected()
    payload = await answered(connection)
    to_client = MockTransport()
    client = SimpleNamespace(transport=to_client, writing_paused=False)
    runs: list[tuple[list[tuple[bytes, int, int, float]], int]] = []
    pump = BodyPump(payload, connection, client, True, lambda data, now: None,  # type: ignore[arg-type]
                    Deadlines(0.0, 0, 0, False), 0.0, feed_reads=lambda reads, size: runs.append((reads, size)))
    pump.start()
    reads = [b"5\r\nhello\r\n", b"1\r\n \r\n", b"c\r\nhello world!\r\n"]
    for read in reads:
        upstream.get_protocol().data_received(read)
    pump.detach()
    ((kept, size),) = runs
    assert [(data, start, end) for data, start, end, _ in kept] == [(reads[0], 3, 8), (reads[1], 3, 4),
                                                                    (reads[2], 3, 15)]
    assert size == 5 + 1 + 12 and [data[start:end] for data, start, end, _ in kept] == [b"hello", b" ", b"hello world!"]


async def test_a_chunk_split_between_reads_or_longer_than_the_lane_takes_goes_the_careful_way_in_order() -> None:
    long = b"x" * body_pump.LANE_BYTES
    reads = [b"2\r\nab\r\n", b"3\r\nc", b"de\r\n", b"2\r\nfg\r\n", b"%x\r\n%b\r\n" % (len(long), long), b"0\r\n\r\n"]
    pump, _, upstream, to_client, fed = await laned()
    for read in reads:
        upstream.get_protocol().data_received(read)
    assert [data for data, _ in fed] == [b"ab", b"c", b"de", b"fg", long]
    assert bytes(to_client.written) == b"".join(reads) and pump.stopped is Stop.END


async def test_a_client_gone_under_the_lane_stops_the_pump_with_the_reads_before_it_recorded() -> None:
    pump, _, upstream, to_client, fed = await laned()
    upstream.get_protocol().data_received(b"2\r\nab\r\n")
    to_client.close()
    upstream.get_protocol().data_received(b"2\r\ncd\r\n")
    assert pump.stopped is Stop.CLIENT_LEFT and [data for data, _ in fed] == [b"ab"]


async def headed(held: bytes) -> tuple[BodyPump, MockTransport, MockTransport, list[bytes]]:
    """A pump with the response head still to write, `held`: what came with the upstream's head."""
    connection, upstream = connected()
    payload = await answered(connection, CHUNKED_HEAD_HELD + held)
    to_client = MockTransport()
    client = SimpleNamespace(transport=to_client, writing_paused=False)
    fed: list[bytes] = []
    pump = BodyPump(payload, connection, client, True, lambda data, now: fed.append(data),  # type: ignore[arg-type]
                    Deadlines(0.0, 0, 0, False), 0.0, HEAD)
    return pump, upstream, to_client, fed


CHUNKED_HEAD_HELD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


async def test_the_head_goes_out_with_what_came_with_it_in_one_write_then_reads_take_the_lane() -> None:
    pump, upstream, to_client, fed = await headed(b"5\r\nhello\r\n")
    pump.start()
    assert to_client.writes == [HEAD + b"5\r\nhello\r\n"] and fed == [b"hello"]
    upstream.get_protocol().data_received(b"1\r\n \r\n")
    assert to_client.writes[1:] == [b"1\r\n \r\n"] and pump._lane  # (the usual read, after the first)
    upstream.get_protocol().data_received(b"0\r\n\r\n")
    assert pump.stopped is Stop.END and fed == [b"hello", b" "]


async def test_a_head_with_nothing_after_it_goes_out_alone_when_the_pump_starts() -> None:
    """The client hears of the answer at once, not when the server's first token comes."""
    pump, upstream, to_client, _ = await headed(b"")
    pump.start()
    assert to_client.writes == [HEAD]
    upstream.get_protocol().data_received(b"5\r\nhello\r\n")
    assert to_client.writes == [HEAD, b"5\r\nhello\r\n"]


async def test_a_head_never_started_goes_out_when_the_pump_detaches_and_only_once() -> None:
    """A shutdown before the pump started: the end that follows needs the head before it."""
    pump, _, to_client, _ = await headed(b"5\r\nhello\r\n")
    pump.detach()
    pump.detach()
    assert to_client.writes == [HEAD]


async def test_a_head_is_not_written_to_a_client_that_has_gone() -> None:
    pump, _, to_client, _ = await headed(b"")
    to_client.closed = True
    pump.start()
    pump.detach()
    assert to_client.writes == []


@pytest.mark.parametrize("held", [b"5\r\nhello\r\n", b""])
async def test_the_records_reading_of_the_answer_begins_after_the_first_write_and_once(held: bytes) -> None:
    """The answer's first bytes wait for none of the record's work: `begin` runs after they went
    out (with the head), once, and what it returns takes every payload from then on, in order."""
    connection, upstream = connected()
    payload = await answered(connection, CHUNKED_HEAD_HELD + held)
    to_client = MockTransport()
    client = SimpleNamespace(transport=to_client, writing_paused=False)
    fed: list[bytes] = []
    begun: list[list[bytes]] = []

    def begin() -> tuple[Callable[[bytes, float], None], None]:
        begun.append(list(to_client.writes))
        return (lambda data, now: fed.append(data)), None

    def unread(data: bytes, now: float) -> None:
        raise AssertionError("a payload fed before the record's reading began")

    pump = BodyPump(payload, connection, client, True, unread, Deadlines(0.0, 0, 0, False), 0.0,  # type: ignore[arg-type]
                    HEAD, begin=begin)
    pump.start()
    for read in (b"1\r\n \r\n", b"3\r\nabc\r\n", b"0\r\n\r\n"):
        upstream.get_protocol().data_received(read)
    assert len(begun) == 1 and begun[0][0] == HEAD + held  # the head and what came with it, out first
    assert fed == [b"hello", b" ", b"abc"] if held else fed == [b" ", b"abc"]
    assert pump.stopped is Stop.END
