"""An answer's body moved to the client inside the upstream connection's own callback.

A server streams one event per write. Read by a coroutine, each such write costs a future, a wake-up
of the relaying task one loop turn later, and the writer's generality: more than the relay itself.
The pump instead runs where the bytes arrive, and the exchange's coroutine waits only for what
needs it: the end, a break, the client gone, or a client too slow to take more (it then waits for
the client to drain while the upstream is not read).

Two ways, by the answer's framing:
- A chunked body (every stream) never enters aiohttp's parser: the connection holds it past the
  head (`Connection.take_body`), and each read is checked (`relay.chunked`), written to the client
  as it came, framing and all, then its payload handed to the record.
- Any other body (a length, or up to the close) is parsed by aiohttp's reader as before; after
  each read the pump takes what the reader holds, writes it (one chunk per read for a chunked
  client), then hands it to the record.

Either way a read is written before it is recorded, and the record sees the payload bytes in order.
Where the record's reading of the answer is still to begin (`begin`), it begins after the first
write, so the answer's first bytes wait for none of it.
A response head still to be written (`head`) goes out with the body's first bytes when they came
with it, in one write, else alone when the pump has started (or at the latest when it detaches).

The usual read (one whole chunk of at most LANE_BYTES, for a chunked client, with no idle timeout
to re-arm) takes the lane: checked, written, and kept with its arrival time; what the lane keeps
goes to the record in runs (LANE_READS, or sooner: any other read, a client that holds bytes back,
the pump's stop or detach). At one event per write a server's reads come milliseconds apart and
each runs cold: the lane does per read only what cannot wait, and the rest once per run (side by
side, `benchmarks/side_by_side.py`: 1-2 % less CPU per event than the read-by-read way). The record
is the same: every read keeps its own time and order.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable

from aiohttp.base_protocol import BaseProtocol
from aiohttp.client_exceptions import ClientPayloadError
from aiohttp.streams import StreamReader

from proxy.relay.chunked import ChunkedBody, FramingError, chunk_start
from proxy.relay.deadlines import Deadlines
from proxy.relay.upstream.connection import Connection
from proxy.wire.parsers import Read

# What begins the record's reading of an answer: it returns the two sinks (`feed`, `feed_reads`).
Begin = Callable[[], tuple[Callable[[bytes, float], None], Callable[[list[Read], int], None] | None]]
LANE_READS = 16  # reads the lane keeps before they go to the record
LANE_BYTES = 1024  # the longest read the lane takes: what it keeps stays under LANE_READS KiB


class Stop(enum.Enum):
    END = "end"  # the body ended
    BROKE = "broke"  # the upstream's connection or framing broke: `error` says how
    CLIENT_LEFT = "client_left"  # the client's connection closed under a write
    PAUSED = "paused"  # the client takes no more for now: drain, then `resume()`
    FAILED = "failed"  # the pump's own code raised (a defect of the proxy's): `error` is what


class BodyPump:
    """`start()`, then await `waiter` until `stopped` is not PAUSED (after PAUSED: drain, `resume()`)."""

    __slots__ = ("_again", "_begin", "_busy", "_chunked", "_client", "_connection", "_content", "_feed", "_feed_reads",
                 "_framing", "_head", "_idle_armed", "_kept", "_lane", "_lost", "_transport", "deadlines", "ended_at",
                 "error", "last", "max_gap", "read", "stopped", "waiter")

    def __init__(self, content: StreamReader, connection: Connection, client: BaseProtocol, chunked: bool,
                 feed: Callable[[bytes, float], None], deadlines: Deadlines, last: float, head: bytes = b"",
                 feed_reads: Callable[[list[Read], int], None] | None = None, begin: Begin | None = None) -> None:
        """`feed(payload, time)` takes each read's payload, `feed_reads(reads, size)` a run of them
        the lane kept, each left in its read (by default, each goes to `feed`). With `begin`, the
        two are what `begin()` returns, called once, after the first write and before the first
        feed (the record's reading of the answer begun)."""
        self._content = content
        self._head = head  # the response head, still to be written
        self._connection = connection
        self._client = client  # the client's protocol: its transport, and whether its writing is paused
        self._chunked = chunked  # the client's body is chunked: each read goes as one chunk
        # A chunked answer the connection holds past its parser: relayed with its own framing.
        self._framing = ChunkedBody() if connection.raw_body else None
        self._lost = False  # the connection was lost while the pump was paused
        self._feed = feed
        self._feed_reads = feed_reads or self._each
        self._begin = begin
        if begin is not None:
            self._feed, self._feed_reads = self._first_feed, self._first_feed_reads
        self.deadlines = deadlines
        self._idle_armed = deadlines.enforce and deadlines.idle_s is not None
        self.read = 0  # body bytes taken from the reader
        self.last = last  # when the last read came (monotonic)
        self.max_gap = 0.0  # the longest wait between two reads
        self.ended_at: float | None = None
        self.stopped: Stop | None = None
        self._busy = False  # in pump(): a call from within it only asks for another turn
        self._again = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._lane = False  # the next read may take the lane (`_open_lane`)
        self._transport: asyncio.Transport | None = client.transport  # the client's, for the lane
        self._kept: list[Read] = []  # the lane's reads, each with its payload's place in it and its time

    @property
    def relays_framing(self) -> bool:
        """The client got the upstream's chunked framing as it came, its last chunk included."""
        return self._framing is not None and self._chunked

    def start(self) -> None:
        """Write the head with what came with it, then take every later read as it comes."""
        if self._framing is not None:
            if not self._head:
                self._open_lane()
            self._connection.take_body(self.take)  # (what came with the head, taken now: with the head)
        else:
            self._connection.on_data = self.pump
            self.pump(not self._connection.is_connected())
        if self._head:  # nothing came with it
            self._write_head()
            self._open_lane()

    def _write_head(self) -> None:
        head, self._head = self._head, b""
        transport = self._transport
        if head and transport is not None and not transport.is_closing():
            transport.write(head)

    def resume(self) -> None:
        """After PAUSED, once the client drained."""
        self.stopped = None
        self.waiter = asyncio.get_running_loop().create_future()
        if self._framing is None:
            self.pump(not self._connection.is_connected())
            return
        self._open_lane()
        self._connection.resume_body()
        if self._lost:
            self.take(b"", True)

    def detach(self) -> None:
        """Take no more reads (idempotent); a pooled connection outlives its exchange. What the
        lane kept goes to the record first."""
        self._lane = False
        self._record_kept()
        self._write_head()  # (the pump never started: what follows it needs the head before it)
        connection = self._connection
        if connection.on_data == self.pump:
            connection.on_data = None
        connection.stop_taking(self.take)

    def take(self, data: bytes, lost: bool = False) -> None:
        """A read of a chunked body, as it came: checked, to the client, then its payload to the
        record; `lost`: the connection closed. (Run in the connection's read callback: a failure
        of its own stops the pump, FAILED, for the exchange to end; raised there, asyncio would
        drop the upstream connection and the record would blame the upstream.)"""
        try:
            if self._lane and not lost and len(data) <= LANE_BYTES:  # the usual read: see the module's docstring
                start = chunk_start(data)
                transport = self._transport
                if start and transport is not None and not transport.is_closing():
                    transport.write(data)
                    kept = self._kept
                    kept.append((data, start, len(data) - 2, time.monotonic()))
                    if len(kept) >= LANE_READS:
                        self._record_kept()
                    if transport.get_write_buffer_size() and self._client.writing_paused:  # (nothing held)
                        self._connection.pause_body()
                        self._stop(Stop.PAUSED)
                    return
            self._record_kept()
            self._take(data, lost)
            self._open_lane()
        except Exception as exc:
            self._failed(exc)

    def _failed(self, error: Exception) -> None:
        """The pump's own code raised: it takes no more, and the exchange ends (`Stop.FAILED`)."""
        if self.stopped is Stop.FAILED:
            return
        self.error = error
        self.stopped = Stop.FAILED
        # Nothing more of it goes anywhere (the exchange breaks the client's connection): what
        # detaching then does is only to take no more reads.
        self._lane, self._kept, self._head = False, [], b""
        self.detach()
        waiter = self.waiter
        if not waiter.done():
            waiter.set_result(None)

    def _open_lane(self) -> None:
        """The next read may take the lane: the pump takes reads, the framing is between chunks,
        the client's body is chunked, and no idle timeout is re-armed per read."""
        framing = self._framing
        self._lane = (self.stopped is None and framing is not None and framing.between_chunks and self._chunked
                      and not self._idle_armed and self._transport is not None)

    def _record_kept(self) -> None:
        """The lane's reads to the record, in order, each with its time (idempotent)."""
        kept = self._kept
        if not kept:
            return
        self._kept = []
        last, longest, size = self.last, self.max_gap, 0
        for _, start, end, now in kept:
            gap = now - last
            if gap > longest:
                longest = gap
            last = now
            size += end - start
        self.last, self.max_gap = last, longest
        self._feed_reads(kept, size)  # (the record keeps the list)

    def _begun(self) -> None:
        begin, self._begin = self._begin, None
        assert begin is not None
        self._feed, feed_reads = begin()
        self._feed_reads = feed_reads or self._each

    def _first_feed(self, data: bytes, now: float) -> None:
        self._begun()
        self._feed(data, now)

    def _first_feed_reads(self, reads: list[Read], size: int) -> None:
        self._begun()
        self._feed_reads(reads, size)

    def _each(self, reads: list[Read], size: int) -> None:
        feed = self._feed
        for data, start, end, now in reads:
            feed(data[start:end], now)

    def _take(self, data: bytes, lost: bool) -> None:
        """`take`, for every read the lane does not take."""
        if self.stopped is not None:
            self._lost = self._lost or lost
            return
        framing = self._framing
        assert framing is not None
        if data:  # through the framing's parser (a read of one whole chunk takes its own fast way there)
            try:
                out, pieces = framing.feed(data)
            except FramingError as exc:  # what came before the fault goes on; the client's connection breaks
                self.error = ClientPayloadError(f"invalid chunked framing: {exc}")
                out, pieces = exc.relayable, exc.pieces
                self._stop(Stop.BROKE)
            now = time.monotonic()
            transport = self._arrived(now)
            if transport is None:
                return
            client = self._client
            head, self._head = self._head, b""  # (only ever given for a chunked client)
            if not self._chunked:  # an HTTP/1.0 client: the payload alone, ended by the close
                for piece in pieces:
                    transport.write(piece)
            elif framing.done:
                transport.write(head + out + framing.ending())
            elif out or head:
                transport.write(head + out)
            if pieces:  # one payload per read, however many chunks framed it
                self._feed(pieces[0] if len(pieces) == 1 else b"".join(pieces), now)
            if self.stopped is not None:  # broke: it ends here
                return
            if self._idle_armed:
                self.deadlines.arm(now)
            if framing.done:
                self.ended_at = now
                self._connection.body_read_whole(framing.extra)
                self._stop(Stop.END)
                return
            if transport.get_write_buffer_size() and client.writing_paused:  # (nothing held: not paused)
                self._connection.pause_body()
                self._stop(Stop.PAUSED)
                return
        if lost:
            self.error = ClientPayloadError("Response payload is not completed: the upstream connection "
                                            "closed inside the chunked body")
            self._stop(Stop.BROKE)

    def pump(self, lost: bool = False) -> None:
        """What the reader holds, to the client and then the record; `lost`: the connection closed.

        Re-entered when taking from the reader resumes the connection's reading, which parses what
        it held back: the outer call takes that too, in order."""
        if self._busy:
            self._again = True
            return
        self._busy = True
        try:
            self._again = True
            while self._again and self.stopped is None:
                self._again = False
                self._pump(lost)
        except Exception as exc:  # (as in `take`)
            self._failed(exc)
        finally:
            self._busy = False

    def _pump(self, lost: bool) -> None:
        content = self._content
        error = content.exception()
        if error is not None:
            self.error = error
            self._stop(Stop.BROKE)
            return
        data = content.read_nowait(-1) if content.total_bytes > self.read else b""
        if data:
            now = time.monotonic()
            size = len(data)
            self.read += size
            transport = self._arrived(now)
            if transport is None:
                return
            client = self._client
            if self._chunked:
                transport.write(b"%x\r\n%b\r\n" % (size, data))
            else:
                transport.write(data)
            self._feed(data, now)
            if self._idle_armed:
                self.deadlines.arm(now)
            if client.writing_paused:
                self._stop(Stop.PAUSED)
                return
        if content.at_eof():  # the end, and nothing of the body left in the reader
            self.ended_at = time.monotonic()
            self._stop(Stop.END)
        elif lost:
            # aiohttp's C parser drops a framing error mid-body (an invalid chunk size) on the floor:
            # the connection closes, the body neither ends nor fails.
            self.error = ClientPayloadError("the upstream connection closed without ending the body "
                                            "(invalid framing)")
            self._stop(Stop.BROKE)

    def _arrived(self, now: float) -> asyncio.Transport | None:
        """A read came at `now` (the longest gap kept): the client's transport to write it to, or
        None when the client has gone (the pump then stops, unless it already has)."""
        gap = now - self.last
        if gap > self.max_gap:
            self.max_gap = gap
        self.last = now
        transport = self._client.transport
        if transport is None or transport.is_closing():
            if self.stopped is None:
                self._stop(Stop.CLIENT_LEFT)
            return None
        return transport

    def _stop(self, why: Stop) -> None:
        self._lane = False
        self._record_kept()  # (the record has every read before the pump stops)
        self.stopped = why
        if why is not Stop.PAUSED:  # paused, it stays attached: a loss meanwhile is kept for `resume`
            self.detach()
        waiter = self.waiter
        if not waiter.done():
            waiter.set_result(None)
