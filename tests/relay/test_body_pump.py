"""The pump driven with bytes: a chunked body's reads go to the client as they came and their
payloads to the record; a client that takes no more pauses the upstream, and resumes it."""

from __future__ import annotations

import time
from types import SimpleNamespace

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
