"""Response parsers: a response's bytes in, typed events out, whatever the framing.

Each parser is incremental (`feed` per chunk, `close` at the end) and never raises: what it
cannot read becomes a `ParseError` event, and the bytes have been forwarded regardless. The
framing comes from the content type the server declared; what the JSON means, from the dialect.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from typing import Any, Protocol

import orjson

from proxy.budget import UNLIMITED, ByteBudget
from proxy.dialects.base import Dialect
from proxy.events import DONE, NO_EVENTS, Event, ParseError
from proxy.ndjson import NdjsonDecoder
from proxy.sse import SseDecoder

_NO_EVENTS = NO_EVENTS
_DONE_PAYLOAD = b"[DONE]"

Interpret = Callable[[Any], list[Event]]

# orjson sets aside scratch space of about 13 times its input before it parses (390 MiB for a
# 30 MiB body, measured with orjson 3.13); the standard library's parser peaks at twice its input
# and is as fast on the long strings that make bodies big. Small documents, every streamed event
# among them, stay with orjson.
ORJSON_MAX_BYTES = 256 * 1024


def load_json(payload: bytes | bytearray) -> Any:
    """One JSON document, with memory bounded by twice its size; raises ValueError when unreadable."""
    if len(payload) <= ORJSON_MAX_BYTES:
        return orjson.loads(payload)
    try:
        return json.loads(payload)
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply") from exc


class ResponseParser(Protocol):
    streaming: bool  # a stream of events (SSE, NDJSON), not one JSON document

    def feed(self, chunk: bytes) -> list[Event]: ...

    def close(self) -> list[Event]: ...


def _interpret(interpret: Interpret, payload: bytes | bytearray) -> list[Event]:
    try:
        return interpret(orjson.loads(payload) if len(payload) <= ORJSON_MAX_BYTES else load_json(payload))
    except (ValueError, TypeError, AttributeError) as exc:
        return [ParseError(f"{type(exc).__name__}: {str(exc)[:200]}")]


class SseParser:
    """Server-sent events (OpenAI-compatible, Anthropic, Responses, llama.cpp)."""

    __slots__ = ("_decoder", "_interpret", "_overlong")
    streaming = True

    def __init__(self, interpret: Interpret, max_line: int) -> None:
        self._decoder = SseDecoder(max_line)
        self._interpret = interpret
        self._overlong = 0

    def feed(self, chunk: bytes) -> list[Event]:
        payloads = self._decoder.feed(chunk)
        if self._decoder.overlong_lines != self._overlong:
            self._overlong = self._decoder.overlong_lines
            return [ParseError("a line exceeded the line limit"), *self._events(payloads)]
        return self._events(payloads) if payloads else _NO_EVENTS

    def close(self) -> list[Event]:
        self._decoder.close()
        return _NO_EVENTS

    def _events(self, payloads: list[tuple[bytes | None, bytes]]) -> list[Event]:
        if len(payloads) == 1:  # the common case: one event per chunk
            return self._event(payloads[0][1])
        events: list[Event] = []
        for _, data in payloads:
            events.extend(self._event(data))
        return events

    def _event(self, data: bytes) -> list[Event]:
        if data[:6] == _DONE_PAYLOAD and data.strip() == _DONE_PAYLOAD:
            return [DONE]
        return _interpret(self._interpret, data)


class NdjsonParser:
    """Newline-delimited JSON (Ollama's native stream)."""

    __slots__ = ("_decoder", "_interpret", "_overlong")
    streaming = True

    def __init__(self, interpret: Interpret, max_line: int) -> None:
        self._decoder = NdjsonDecoder(max_line)
        self._interpret = interpret
        self._overlong = 0

    def feed(self, chunk: bytes) -> list[Event]:
        lines = self._decoder.feed(chunk)
        events = self._events(lines) if lines else _NO_EVENTS
        if self._decoder.overlong_lines != self._overlong:
            self._overlong = self._decoder.overlong_lines
            return [ParseError("a line exceeded the line limit"), *events]
        return events

    def close(self) -> list[Event]:
        return self._events(self._decoder.close())

    def _events(self, lines: list[bytes]) -> list[Event]:
        if len(lines) == 1:
            return _interpret(self._interpret, lines[0])
        events: list[Event] = []
        for line in lines:
            events.extend(_interpret(self._interpret, line))
        return events


class JsonBodyParser:
    """A complete (non-streaming) JSON body, read from a bounded copy at the end.

    The copy counts against the body cap and the process-wide budget; past either, the chunks
    held so far are dropped at once and the body is reported unread.
    """

    __slots__ = ("_body", "_budget", "_cap", "_held", "_interpret", "_refused", "_size")
    streaming = False

    def __init__(self, interpret: Interpret, cap: int, budget: ByteBudget = UNLIMITED,
                 declared: int | None = None) -> None:
        self._interpret = interpret
        self._cap = cap
        self._budget = budget
        self._body = bytearray()  # one copy, parsed in place at the end: never a second joined one
        self._size = 0
        self._held = 0  # bytes reserved from the budget
        self._refused: str | None = None
        if declared is not None:  # a declared length is judged at once, and reserved whole
            if declared > cap:
                self._refused = "cap"
            elif budget.reserve(declared):
                self._held = declared
            else:
                self._refused = "budget"

    def feed(self, chunk: bytes) -> list[Event]:
        self._size += len(chunk)
        if self._refused is not None:
            return _NO_EVENTS
        if self._size > self._cap:
            self._drop("cap")
        elif self._size <= self._held:  # within the reservation made for a declared length
            self._body += chunk
        elif not self._budget.reserve(self._size - self._held):
            self._drop("budget")
        else:
            self._held = self._size
            self._body += chunk
        return _NO_EVENTS

    def _drop(self, reason: str) -> None:
        self._refused = reason
        self._body = bytearray()
        self._budget.release(self._held)
        self._held = 0

    def close(self) -> list[Event]:
        if self._refused == "cap":
            return [ParseError(f"body of {self._size} bytes exceeds the {self._cap}-byte parse cap")]
        if self._refused == "budget":
            return [ParseError("the process-wide parse budget (--parse-budget) was spent: body not read")]
        if not self._size:
            return [ParseError("empty body")]
        try:
            events = _interpret(self._interpret, self._body)
        finally:
            self._drop("closed")
        return [*events, DONE] if events and not isinstance(events[0], ParseError) else events


class UnknownParser:
    """A body in a framing we do not read: reported once, forwarded untouched."""

    __slots__ = ("_reason",)
    streaming = False

    def __init__(self, reason: str) -> None:
        self._reason = reason

    def feed(self, chunk: bytes) -> list[Event]:
        return _NO_EVENTS

    def close(self) -> list[Event]:
        return [ParseError(self._reason)]


class DecompressingParser:
    """Reads a gzip- or deflate-encoded body from a copy; the client still gets the encoded bytes."""

    __slots__ = ("_cap", "_inner", "_zlib", "streaming")

    def __init__(self, inner: ResponseParser, encoding: str, cap: int) -> None:
        self._inner = inner
        self.streaming = inner.streaming
        self._cap = cap
        wbits = 16 + zlib.MAX_WBITS if encoding in ("gzip", "x-gzip") else zlib.MAX_WBITS
        self._zlib: Any = zlib.decompressobj(wbits)

    def feed(self, chunk: bytes) -> list[Event]:
        if self._zlib is None:
            return _NO_EVENTS
        try:
            plain = self._zlib.decompress(chunk, self._cap)
        except zlib.error as exc:
            self._zlib = None
            return [ParseError(f"cannot decompress: {exc}")]
        if self._zlib.unconsumed_tail:  # more than the cap out of one chunk: a bomb, stop reading
            self._zlib = None
            return [ParseError("decompressed chunk exceeds the parse cap"), *self._inner.feed(plain)]
        return self._inner.feed(plain)

    def close(self) -> list[Event]:
        return self._inner.close()


def parser_for(dialect: Dialect, content_type: str, content_encoding: str, *, max_line: int, body_cap: int,
               budget: ByteBudget = UNLIMITED, content_length: int | None = None) -> ResponseParser:
    """The parser for one response in `dialect`, its framing chosen by what the server declared."""
    interpret: Interpret = dialect.events
    media = content_type.partition(";")[0].strip().lower()
    parser: ResponseParser
    if media == "text/event-stream":
        parser = SseParser(interpret, max_line)
    elif media in ("application/x-ndjson", "application/ndjson", "application/jsonl"):
        parser = NdjsonParser(interpret, max_line)
    elif media == "application/json" or media.endswith("+json"):
        identity = content_encoding.strip().lower() in ("", "identity")
        parser = JsonBodyParser(interpret, body_cap, budget, content_length if identity else None)
    else:
        parser = UnknownParser(f"unrecognised content type {media or '(none)'!r}")
    encoding = content_encoding.strip().lower()
    if encoding in ("", "identity"):
        return parser
    if encoding in ("gzip", "x-gzip", "deflate"):
        return DecompressingParser(parser, encoding, body_cap)
    return UnknownParser(f"unsupported content encoding {encoding!r}")
