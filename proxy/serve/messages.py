"""What crosses between a worker and its supervisor: one dataclass per kind, over one link each.

A link is a socket pair (duplex). Each message is a frame: a 4-byte big-endian length, then the
message pickled (both ends are this program; nothing else can write to the pair). Nothing per
record crosses it: a worker runs its own observers, and the supervisor asks for what it serves
(a page, a record, the metrics) when someone reads its admin listener.

- worker → supervisor, told: `Listening` (its port is open), `MetricsSnapshot` (its registry, at most
  once a second when it changed, and once more as it stops);
- supervisor → worker, told: `TelemetrySamples` (what the supervisor's pollers read, for each
  worker's records), `ServerSpans` (the server's request spans the admin listener took: every worker
  joins its own records' spans);
- asked, by the supervisor, and answered by the worker: `Settle` → `Settled`, `PageAsked` →
  `PageFound`, `RecordAsked` → `RecordFound`, `RingAsked` → `RingFound`, `MetricsAsked` →
  `MetricsSnapshot`.

A side never blocks on the other: messages told are dropped past SEND_BUFFER_MAX bytes waiting to
be written (the next snapshot or sample makes up for them); answers are always written.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import pickle
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from proxy.observers.record_store import RecordQuery

_log = structlog.get_logger("llm_diag_proxy")
FRAME = struct.Struct(">I")
MAX_MESSAGE = 512 * 1024 * 1024  # an answer of a whole ring is tens of MB; past this the link is broken
SEND_BUFFER_MAX = 8 * 1024 * 1024
ASK_TIMEOUT_S = 5.0


# --- told ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Listening:
    url: str
    pid: int


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """A worker's record metrics (`proxy.observers.metrics_merge.snapshot`, pickled once more so that
    the supervisor keeps it as bytes until it serves it), and its records delivered when it was taken."""

    families: bytes
    delivered: int


@dataclass(frozen=True, slots=True)
class TelemetrySamples:
    """Samples the supervisor's pollers took since the last message, each `(unix time, sample)`,
    and the upstream's process ids where they changed."""

    gpu: tuple[tuple[float, Any], ...] = ()
    upstream: tuple[tuple[float, Any], ...] = ()
    pids: frozenset[int] | None = None


@dataclass(frozen=True, slots=True)
class ServerSpans:
    spans: tuple[Any, ...]  # proxy.servers.traces.ServerSpan


# --- asked and answered --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Settle:
    """Deliver what waits for its batch, and let the history write what it was handed."""


@dataclass(frozen=True, slots=True)
class Settled:
    history_up: bool | None  # None: this worker keeps no history


@dataclass(frozen=True, slots=True)
class PageAsked:
    query: RecordQuery


@dataclass(frozen=True, slots=True)
class PageFound:
    """The newest matching records of a worker's ring, each `(sequence number, JSON)`, newest first;
    `more`: it holds more that match, older than the last."""

    records: list[tuple[int, bytes]]
    more: bool
    stored: int
    capacity: int


@dataclass(frozen=True, slots=True)
class RecordAsked:
    request_id: str


@dataclass(frozen=True, slots=True)
class RecordFound:
    record: bytes | None  # its JSON


@dataclass(frozen=True, slots=True)
class RingAsked:
    query: RecordQuery


@dataclass(frozen=True, slots=True)
class RingFound:
    blobs: list[bytes]  # JSON arrays of records


@dataclass(frozen=True, slots=True)
class MetricsAsked:
    pass


Question = Settle | PageAsked | RecordAsked | RingAsked | MetricsAsked


@dataclass(frozen=True, slots=True)
class Ask:
    number: int
    question: Any


@dataclass(frozen=True, slots=True)
class Answer:
    number: int
    answer: Any
    error: str | None = None


class LinkClosed(Exception):
    """The other side is gone."""


class Link(asyncio.Protocol):
    """One end of a worker's link: frames in and out, questions asked and answered.

    `told(message)` receives what the other side tells; `answer(question)` (a coroutine) answers
    what it asks. The messages written in one turn of the loop go in one write."""

    def __init__(self, told: Callable[[Any], None] = lambda message: None,
                 answer: Callable[[Any], Awaitable[Any]] | None = None) -> None:
        self.told = told
        self.answer = answer
        self.closed = asyncio.Event()
        self.dropped = 0  # messages told that found the link full or closed
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._frames: list[bytes] = []  # this turn's, written at its end
        self._queued = 0  # their bytes
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._numbers = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # (uvloop's are not asyncio.Transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self.closed.set()
        for waiter in self._waiting.values():
            if not waiter.done():
                waiter.set_exception(LinkClosed())
        self._waiting.clear()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while len(buffer) >= FRAME.size:
            (size,) = FRAME.unpack_from(buffer)
            if size > MAX_MESSAGE:
                _log.error("worker_link_broken", detail=f"a message of {size} bytes")
                buffer.clear()
                self.close()
                return
            if len(buffer) < FRAME.size + size:
                return
            payload = bytes(buffer[FRAME.size:FRAME.size + size])
            del buffer[:FRAME.size + size]
            try:
                self._received(pickle.loads(payload))
            except Exception as exc:  # a bad message must not end either side
                _log.warning("worker_message_unreadable", error=repr(exc)[:300])

    def _received(self, message: Any) -> None:
        if isinstance(message, Answer):
            waiter = self._waiting.pop(message.number, None)
            if waiter is not None and not waiter.done():
                if message.error is not None:
                    waiter.set_exception(RuntimeError(message.error))
                else:
                    waiter.set_result(message.answer)
        elif isinstance(message, Ask):
            task = asyncio.get_running_loop().create_task(self._reply(message))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self.told(message)

    async def _reply(self, ask: Ask) -> None:
        try:
            if self.answer is None:
                raise RuntimeError("this side answers no question")
            found = await self.answer(ask.question)
        except Exception as exc:  # a failed answer is said to the asker, never raised here
            self._send(Answer(ask.number, None, f"{type(exc).__name__}: {str(exc)[:300]}"), always=True)
            return
        self._send(Answer(ask.number, found), always=True)

    def tell(self, message: Any, *, always: bool = False) -> bool:
        """Send `message` (False: dropped, the link is closed, or full and not `always`)."""
        return self._send(message, always=always)

    async def ask(self, question: Any, timeout_s: float = ASK_TIMEOUT_S) -> Any:
        """The other side's answer (LinkClosed, TimeoutError, or RuntimeError with its failure)."""
        if self._transport is None or self._transport.is_closing():
            raise LinkClosed()
        number = next(self._numbers)
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[number] = waiter
        self._send(Ask(number, question), always=True)
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        finally:
            self._waiting.pop(number, None)

    def _send(self, message: Any, *, always: bool) -> bool:
        transport = self._transport
        if transport is None or transport.is_closing():
            self.dropped += 1
            return False
        if not always and transport.get_write_buffer_size() + self._queued > SEND_BUFFER_MAX:
            self.dropped += 1
            return False
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if not self._frames:
            asyncio.get_running_loop().call_soon(self._write)
        self._frames.append(FRAME.pack(len(payload)) + payload)
        self._queued += FRAME.size + len(payload)
        return True

    def _write(self) -> None:
        frames, self._frames, self._queued = self._frames, [], 0
        if frames and self._transport is not None and not self._transport.is_closing():
            self._transport.write(b"".join(frames))

    async def drain(self, timeout_s: float) -> None:
        """Wait until what was sent reached the socket (bounded)."""
        self._write()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (self._transport is not None and self._transport.get_write_buffer_size()
               and loop.time() < deadline):
            await asyncio.sleep(0.01)

    def close(self) -> None:
        if self._transport is not None:
            self._write()
            self._transport.close()

    async def wait_answers(self) -> None:
        """The answers still being made (at the end)."""
        if self._tasks:
            with contextlib.suppress(Exception):
                await asyncio.gather(*self._tasks, return_exceptions=True)
