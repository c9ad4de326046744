"""Response parsers: a response's bytes in, typed events out, whatever the framing.

Each parser is incremental (`feed` per chunk, `close` at the end) and never raises: what it
cannot read becomes a `ParseError` event, and the bytes have been forwarded regardless. The
framing comes from the content type the server declared; what the JSON means, from the dialect.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import orjson

from proxy.wire.dialects.base import Dialect
from proxy.wire.events import DONE, NO_EVENTS, Event, ParseError, TokenDelta
from proxy.wire.fast_tokens import EVENTS, NOT_PLAIN, REASONING, UNSAFE, VISIBLE, PlainTokens, memory_of
from proxy.wire.ndjson import NdjsonDecoder
from proxy.wire.parse_bytes import UNLIMITED, ParseBytes
from proxy.wire.sse import SseDecoder

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


# One read of a response body as the tally keeps it: the bytes that came, where its payload starts
# and ends in them (a chunk's payload, inside its framing: no copy is made of it), and when it came.
Read = tuple[bytes, int, int, float]


class ResponseParser(Protocol):
    streaming: bool  # a stream of events (SSE, NDJSON), not one JSON document

    def feed(self, chunk: bytes) -> Sequence[Event]: ...

    def plain_reads(self, reads: list[Read], start: int) -> int: ...

    def close(self) -> Sequence[Event]: ...


def _interpret(interpret: Interpret, payload: bytes | bytearray) -> Sequence[Event]:
    try:
        return interpret(orjson.loads(payload) if len(payload) <= ORJSON_MAX_BYTES else load_json(payload))
    except (ValueError, TypeError, AttributeError) as exc:
        return [ParseError(f"{type(exc).__name__}: {str(exc)[:200]}")]


class _StreamParser:
    """What SSE and NDJSON share: one payload in, its events out, plain tokens counted from their
    bytes where the response's learned shapes allow (proxy/wire/fast_tokens.py), the rest decoded."""

    __slots__ = ("_framed", "_interpret", "_max_line", "_one_ready", "_overlong", "_plain")
    streaming = True
    SEPARATOR = b"\n"  # what ends one payload: a line (NDJSON), a blank line (SSE)
    OPENING = b""  # what opens a payload that is a read of its own (`_one`, `plain_reads`)

    def __init__(self, interpret: Interpret, max_line: int, plain: PlainTokens | None) -> None:
        self._interpret = interpret
        self._max_line = max_line
        self._overlong = 0
        self._plain = plain
        # The decoder holds nothing and a shape is known (an earlier response's, at first): `_one` may answer.
        self._one_ready = plain is not None and bool(plain.shapes)
        # The one learned shape, framed as a read of its own: (its shape, head, tail), for `plain_reads`.
        self._framed: tuple[tuple[bytes, bytes, int], bytes, bytes] | None = None

    def feed(self, chunk: bytes) -> Sequence[Event]:
        if self._one_ready:  # a server's usual read: one plain token event, whole
            events = self._one(chunk)
            if events is not None:
                return events
        before = self._overlong
        events = self._feed_read(chunk)
        plain = self._plain
        self._one_ready = plain is not None and bool(plain.shapes) and self._clean()
        return events if self._overlong == before or events[0] is OVERLONG else _overlong_first(events)

    def _one(self, chunk: bytes) -> Sequence[Event] | None:
        """The events of a read that is one whole payload the learned shapes count, exactly as the
        longer way gives them (a clean decoder, no CR, within the line limit); else None."""
        opening, separator = self.OPENING, self.SEPARATOR
        if not chunk.startswith(opening) or not chunk.endswith(separator):
            return None
        if len(chunk) - len(separator) > self._max_line:
            return None
        assert self._plain is not None
        found = self._plain.count(chunk[len(opening):-len(separator)])  # a counted payload holds no CR or LF
        return None if found == NOT_PLAIN else EVENTS[found]

    def plain_reads(self, reads: list[Read], start: int) -> int:
        """How many of `reads`, from `start` on, are each one whole event of one visible token in
        the response's one learned shape: what `feed` answers each of them with (`_one`: one
        token, nothing changed), found in one loop for a run of reads (the tally counts them)."""
        if not self._one_ready:
            return 0
        assert self._plain is not None
        only = self._plain.only
        if only is None or only[2] != VISIBLE:
            return 0
        framed = self._framed
        if framed is None or framed[0] is not only:
            framed = self._framed = (only, self.OPENING + only[0], only[1] + self.SEPARATOR)
        _, head, tail = framed
        opened, closed = len(head), len(tail)
        shortest, longest = opened + closed, self._max_line + len(self.SEPARATOR)
        unsafe = UNSAFE.search
        at, end = start, len(reads)
        while at < end:  # (a payload's framing, around it in its read, is ASCII: isascii() may see it too)
            data, begin, stop, _ = reads[at]
            size = stop - begin
            if (size <= shortest or size > longest or not data.startswith(head, begin)
                    or not data.endswith(tail, begin, stop) or not data.isascii()
                    or unsafe(data, begin + opened, stop - closed) is not None):
                break
            at += 1
        return at - start

    def _feed_read(self, chunk: bytes) -> Sequence[Event]:
        """One read: its complete payloads through the fast path, the rest through the decoder."""
        if self._plain is None or b"\r" in chunk:
            return self._decode(chunk)
        separator = self.SEPARATOR
        if not self._clean():  # the last read ended inside a payload: the decoder finishes it
            first = chunk.find(separator)
            if first < 0:
                return self._decode(chunk)
            finished = self._decode(chunk[:first + len(separator)])  # it ends on a separator: clean
            rest = chunk[first + len(separator):]
            end = rest.rfind(separator)
            if end < 0 or not self._clean():  # (a CR of the last read can still be pending)
                more = self._decode(rest) if rest else []
            else:
                more = self._feed_complete(rest, end, self._plain)
            return [*finished, *more] if finished else more
        end = chunk.rfind(separator)
        if end >= 0:
            return self._feed_complete(chunk, end, self._plain)
        return self._decode(chunk)

    def _clean(self) -> bool:
        """The decoder holds nothing of a payload begun in an earlier read."""
        raise NotImplementedError

    def _decode(self, chunk: bytes) -> Sequence[Event]:
        """A read through the decoder, byte by byte as it frames them."""
        raise NotImplementedError

    def _feed_complete(self, chunk: bytes, end: int, plain: PlainTokens) -> Sequence[Event]:
        """The read's complete payloads (up to `end`, a separator) by the fast path, then the rest."""
        raise NotImplementedError

    def _payload(self, data: bytes) -> Sequence[Event]:
        plain = self._plain
        if plain is None:
            return _interpret(self._interpret, data)
        found = plain.count(data)
        if found != NOT_PLAIN:
            return EVENTS[found]
        events = _interpret(self._interpret, data)
        plain.decoded(data, events)
        return events


OVERLONG = ParseError("a line exceeded the line limit")


def _overlong_first(events: Sequence[Event]) -> Sequence[Event]:
    """A read's events with one over-long report, first. The decoder reports a read's over-long
    lines before its events (it counts them while it splits); the fast path meets them in order.
    Either way the record is then the same."""
    return [OVERLONG, *(event for event in events if event is not OVERLONG)]


def _tokens(events: list[Event], visible: int, reasoning: int) -> Sequence[Event]:
    """The plain tokens of one read, counted into one event of each kind."""
    if visible:
        events.append(TokenDelta(visible))
    if reasoning:
        events.append(TokenDelta(reasoning, reasoning=True))
    return events


def _all_plain(chunk: bytes, end: int, head: bytes, tail: bytes, limit: int) -> int:
    """How many blocks chunk[:end] holds when every one is `head`, a non-empty plain string body
    and `tail` within `limit` bytes (what the block-by-block test accepts), else 0.

    With every block of that shape, the bytes between the first head and the last tail split at
    `tail` + blank line + `head` into the bodies: a body holds no quote and `tail` opens with
    one, so no body can hold the separator. A block of any other shape leaves a quote or a line
    feed in some piece, and UNSAFE finds it."""
    if not chunk.startswith(head) or not chunk.endswith(tail, 0, end):
        return 0
    bodies = chunk[len(head):end - len(tail)].split(tail + b"\n\n" + head)
    if b"" in bodies or UNSAFE.search(b"".join(bodies)) is not None:
        return 0
    if max(map(len, bodies)) > limit - len(head) - len(tail):
        return 0
    return len(bodies)


class SseParser(_StreamParser):
    """Server-sent events (OpenAI-compatible, Anthropic, Responses, llama.cpp).

    The fast path works once per read, not per event: when the decoder holds nothing and the read
    has no CR, the complete events in it are split at their blank lines in one call, and an event
    of one `data:` line (after an optional `event:` line) is taken as it stands: counted when it
    is a plain token, else decoded, in order; anything else, and what the read leaves open, goes
    through the decoder. Records come out identical either way (tests/wire/test_fast_tokens.py).
    """

    __slots__ = ("_decoder",)
    SEPARATOR = b"\n\n"
    OPENING = b"data: "

    def __init__(self, interpret: Interpret, max_line: int, plain: PlainTokens | None = None) -> None:
        super().__init__(interpret, max_line, plain)
        self._decoder = SseDecoder(max_line)

    def _clean(self) -> bool:
        return self._decoder.clean

    def _decode(self, chunk: bytes) -> Sequence[Event]:
        payloads = self._decoder.feed(chunk)
        if self._decoder.overlong_lines != self._overlong:
            self._overlong = self._decoder.overlong_lines
            return [OVERLONG, *self._events(payloads)]
        return self._events(payloads) if payloads else _NO_EVENTS

    def _feed_complete(self, chunk: bytes, end: int, plain: PlainTokens) -> Sequence[Event]:
        """The read's complete events (up to `end`, a blank line), then what it leaves open.

        The one learned shape of a response is tried against the whole read first
        (`_all_plain`: a handful of C calls, however many events), then block by block (`data: `
        and all): the common case costs two comparisons and one search per event.
        """
        events: list[Event] = []
        visible = reasoning = 0
        limit = self._max_line
        ascii_read = chunk.isascii()
        unsafe = UNSAFE.search
        inline = plain.inline(b"data: ") if ascii_read else None
        if inline is not None:
            head, tail, kind = inline
            found = _all_plain(chunk, end, head, tail, limit)
            if found:
                events.append(TokenDelta(found, reasoning=kind == REASONING))
                if end + 2 < len(chunk):
                    events.extend(self._decode(chunk[end + 2:]))
                return events
        for block in chunk[:end].split(b"\n\n"):
            if inline is not None:
                head, tail, kind = inline
                if block.startswith(head) and block.endswith(tail) and len(block) <= limit:
                    stop = len(block) - len(tail)
                    if stop > len(head) and unsafe(block, len(head), stop) is None:
                        if kind == VISIBLE:
                            visible += 1
                        else:
                            reasoning += 1
                        continue
            if block.startswith(b"data: "):
                start = 6
            elif block.startswith(b"event:"):
                start = block.find(b"\n") + 1
                start = start + 6 if start and block.startswith(b"data: ", start) else -1
            else:
                start = -1
            if start < 0 or len(block) > limit or block.find(b"\n", start) >= 0:
                if block:
                    events.extend(self._decode(block + b"\n\n"))  # the decoder is clean: exact
                continue
            data = block[start:]
            found = plain.count(data)
            if found == VISIBLE:
                visible += 1
            elif found == REASONING:
                reasoning += 1
            elif found == NOT_PLAIN:
                events.extend(self._event(data))
                if ascii_read:
                    inline = plain.inline(b"data: ")  # what was decoded may have taught a shape
        if visible:
            events.append(TokenDelta(visible))
        if reasoning:
            events.append(TokenDelta(reasoning, reasoning=True))
        if end + 2 < len(chunk):
            events.extend(self._decode(chunk[end + 2:]))
        return events

    def close(self) -> Sequence[Event]:
        self._decoder.close()
        return _NO_EVENTS

    def _events(self, payloads: list[tuple[bytes | None, bytes]]) -> Sequence[Event]:
        if len(payloads) == 1:  # the common case: one event per chunk
            return self._event(payloads[0][1])
        events: list[Event] = []
        for _, data in payloads:
            events.extend(self._event(data))
        return events

    def _event(self, data: bytes) -> Sequence[Event]:
        if data[:6] == _DONE_PAYLOAD and data.strip() == _DONE_PAYLOAD:
            return [DONE]
        return self._payload(data)


class NdjsonParser(_StreamParser):
    """Newline-delimited JSON (Ollama's native stream), with the same per-read fast path as SSE."""

    __slots__ = ("_decoder",)

    def __init__(self, interpret: Interpret, max_line: int, plain: PlainTokens | None = None) -> None:
        super().__init__(interpret, max_line, plain)
        self._decoder = NdjsonDecoder(max_line)

    def _clean(self) -> bool:
        return self._decoder.clean

    def _decode(self, chunk: bytes) -> Sequence[Event]:
        lines = self._decoder.feed(chunk)
        events = self._events(lines) if lines else _NO_EVENTS
        if self._decoder.overlong_lines != self._overlong:
            self._overlong = self._decoder.overlong_lines
            return [OVERLONG, *events]
        return events

    def _feed_complete(self, chunk: bytes, end: int, plain: PlainTokens) -> Sequence[Event]:
        events: list[Event] = []
        counts = [0, 0, 0]  # by plain.count's answer: empty, visible, reasoning
        limit = self._max_line
        count = plain.count
        for line in chunk[:end].split(b"\n"):
            if len(line) > limit:
                events.extend(self._decode(line + b"\n"))  # dropped and counted, as the decoder does
                continue
            found = count(line)
            if found == NOT_PLAIN:
                if line.strip():
                    events.extend(self._payload(line))
            elif found:
                counts[found] += 1
        _tokens(events, counts[VISIBLE], counts[REASONING])
        if end + 1 < len(chunk):
            events.extend(self._decode(chunk[end + 1:]))
        return events

    def close(self) -> Sequence[Event]:
        return self._events(self._decoder.close())

    def _events(self, lines: list[bytes]) -> Sequence[Event]:
        if len(lines) == 1:
            return self._payload(lines[0])
        events: list[Event] = []
        for line in lines:
            events.extend(self._payload(line))
        return events


class JsonBodyParser:
    """A complete (non-streaming) JSON body, read from a bounded copy at the end.

    The copy counts against the body cap and the process-wide bytes held for parsing; past either, the chunks
    held so far are dropped at once and the body is reported unread.
    """

    __slots__ = ("_body", "_cap", "_held", "_interpret", "_parse_bytes", "_refused", "_size")
    streaming = False

    def __init__(self, interpret: Interpret, cap: int, parse_bytes: ParseBytes = UNLIMITED,
                 declared: int | None = None) -> None:
        self._interpret = interpret
        self._cap = cap
        self._parse_bytes = parse_bytes
        self._body = bytearray()  # one copy, parsed in place at the end: never a second joined one
        self._size = 0
        self._held = 0  # bytes reserved from the bytes held for parsing
        self._refused: str | None = None
        if declared is not None:  # a declared length is judged at once, and reserved whole
            if declared > cap:
                self._refused = "cap"
            elif parse_bytes.reserve(declared):
                self._held = declared
            else:
                self._refused = "parse_bytes"

    def feed(self, chunk: bytes) -> Sequence[Event]:
        self._size += len(chunk)
        if self._refused is not None:
            return _NO_EVENTS
        if self._size > self._cap:
            self._drop("cap")
        elif self._size <= self._held:  # within the reservation made for a declared length
            self._body += chunk
        elif not self._parse_bytes.reserve(self._size - self._held):
            self._drop("parse_bytes")
        else:
            self._held = self._size
            self._body += chunk
        return _NO_EVENTS

    def _drop(self, reason: str) -> None:
        self._refused = reason
        self._body = bytearray()
        self._parse_bytes.release(self._held)
        self._held = 0

    def plain_reads(self, reads: list[Read], start: int) -> int:
        return 0

    def close(self) -> Sequence[Event]:
        if self._refused == "cap":
            return [ParseError(f"body of {self._size} bytes exceeds the {self._cap}-byte parse cap")]
        if self._refused == "parse_bytes":
            return [ParseError("the process-wide bytes held for parsing (--parse-bytes) ran out: body not read")]
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

    def feed(self, chunk: bytes) -> Sequence[Event]:
        return _NO_EVENTS

    def plain_reads(self, reads: list[Read], start: int) -> int:
        return 0

    def close(self) -> Sequence[Event]:
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

    def feed(self, chunk: bytes) -> Sequence[Event]:
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

    def plain_reads(self, reads: list[Read], start: int) -> int:
        return 0  # the reads are not the events: each goes through the decompressor

    def close(self) -> Sequence[Event]:
        return self._inner.close()


def parser_for(dialect: Dialect, content_type: str, content_encoding: str, *, max_line: int, body_cap: int,
               parse_bytes: ParseBytes = UNLIMITED, content_length: int | None = None,
               fast_path: bool = True, texts: bool = False) -> ResponseParser:
    """The parser for one response in `dialect`, its framing chosen by what the server declared
    (`fast_path=False`: every event decoded, as the differential tests compare; `texts`: the
    answer's structured text read too, every event decoded)."""
    interpret: Interpret = dialect.events
    if texts:
        events, read_texts = dialect.events, dialect.texts
        interpret = lambda obj: [*events(obj), *read_texts(obj)]  # noqa: E731
        fast_path = False
    keys = dialect.token_keys, dialect.reasoning_keys
    plain = (PlainTokens(interpret, *keys, memory=memory_of(interpret, *keys))
             if fast_path and (dialect.token_keys or dialect.reasoning_keys) else None)
    media = content_type.partition(";")[0].strip().lower()
    parser: ResponseParser
    if media == "text/event-stream":
        parser = SseParser(interpret, max_line, plain)
    elif media in ("application/x-ndjson", "application/ndjson", "application/jsonl"):
        parser = NdjsonParser(interpret, max_line, plain)
    elif media == "application/json" or media.endswith("+json"):
        identity = content_encoding.strip().lower() in ("", "identity")
        parser = JsonBodyParser(interpret, body_cap, parse_bytes, content_length if identity else None)
    else:
        parser = UnknownParser(f"unrecognised content type {media or '(none)'!r}")
    encoding = content_encoding.strip().lower()
    if encoding in ("", "identity"):
        return parser
    if encoding in ("gzip", "x-gzip", "deflate"):
        return DecompressingParser(parser, encoding, body_cap)
    return UnknownParser(f"unsupported content encoding {encoding!r}")
