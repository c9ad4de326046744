"""Plain token events told from their bytes: the parsers' fast path, exact by construction.

Most events of a stream are one generated token in the same shape: vLLM's
`{"id":...,"choices":[{"index":0,"delta":{"content":"<text>"},"logprobs":null,"finish_reason":null}]}`,
with only `<text>` changing. Decoding each costs more than everything else the proxy does per
event. So, per response, the first such event is decoded as usual and its shape is learned: the
bytes before the token's string (`head`) and after it (`tail`). The shape is checked before it is
used: the same bytes with the string emptied must decode to no token, so that string is the one
the dialect reads. A later event whose bytes are `head`, a plain JSON string body and `tail` is then
one token without decoding: the same JSON with another string, which the dialects read only for
being empty or not.

Some servers change one scalar before the token in every event (Ollama's `created_at`, the
Responses API's `sequence_number`). When two shapes one response learned differ in exactly one such
scalar, the shape keeps a hole there, checked the same way (another value must decode alike). Up
to SHAPES_PER_KIND are kept per kind, the latest first: an OpenAI-style answer names the role in
its first token's event only, so it has two.

A learned shape holds no CR or LF, and a plain body or hole holds no control byte, so an event the
shapes count is one line: a parser may take a read of one such event whole without splitting it.

A string body is plain when it holds no quote, no control byte, no escape other than
`\\n \\t \\" \\\\ \\/ \\b \\f \\r`, and is valid UTF-8: then the event is valid JSON exactly when the
learned one was. Anything else is decoded, so records are the same with and without this path
(tests/wire/test_fast_tokens.py compares them over random streams and cuts).

What one response learned serves the next ones of its dialect (`ShapeMemory`, process-wide and
bounded): a shape says what bytes decode to, whatever the response, because the dialects' reading
is pure (the same JSON, the same events). A response starts with the shapes the last one of its
dialect ended with, and a check already made is not decoded again. Where a server's events keep
their shape from one answer to the next (Ollama's lines, Anthropic's deltas) an answer is then
counted without learning anything; where they carry the answer's own id (vLLM), each answer learns
its shape as before.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from proxy.wire.events import ONE_REASONING_TOKEN, ONE_TOKEN, Event

Interpret = Callable[[Any], list[Event]]

_STRING_BODY = re.compile(rb'(?:[^"\\]|\\.)*', re.DOTALL)  # up to the closing quote of a JSON string
UNSAFE = re.compile(rb'["\\\x00-\x1f]')  # a body without these is a plain JSON string body
_LINE_BREAK = re.compile(rb"[\r\n]")  # never in a learned shape
_ESCAPED_BODY = re.compile(rb'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt])*')
_NUMBER = re.compile(rb'-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?')
_PLAIN_SCALAR = re.compile(rb'[^"\\\x00-\x1f]*')  # a string hole's body: no escapes at all
NOT_PLAIN, EMPTY, VISIBLE, REASONING = -1, 0, 1, 2  # what `PlainTokens.count` says of an event
EVENTS: dict[int, tuple[Event, ...]] = {EMPTY: (), VISIBLE: (ONE_TOKEN,), REASONING: (ONE_REASONING_TOKEN,)}
MAX_LEARNED = 64  # shapes learned per response; past it (a shape that never repeats) all is decoded
SHAPES_PER_KIND = 2  # kept per kind (visible, reasoning): an answer's first token event and the rest
MAX_CHECKS = 128  # checks a dialect's memory keeps (the oldest goes first), each of at most CHECK_BYTES
CHECK_BYTES = 2048
MAX_MEMORIES = 16  # dialects with a memory (the proxy has five; more are each response's own)


def _body_is_plain(data: bytes, start: int, end: int) -> bool:
    """data[start:end] is a JSON string body that needs no decoding to be judged valid, and the
    whole event valid UTF-8 (a hole's bytes included)."""
    if UNSAFE.search(data, start, end) is not None and _ESCAPED_BODY.fullmatch(data, start, end) is None:
        return False
    if data.isascii():
        return True
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _common_prefix(a: bytes, b: bytes) -> int:
    """The length of the longest prefix `a` and `b` share: a halving search of slice compares (a
    shape's head is a few hundred bytes: a byte-by-byte loop cost about a twentieth of a record's making)."""
    same, limit = 0, min(len(a), len(b))
    while same < limit:  # a[:same] == b[:same], and the shared prefix is at most `limit`
        middle = (same + limit + 1) // 2
        if a[same:middle] == b[same:middle]:
            same = middle
        else:
            limit = middle - 1
    return same


class Shape:
    """One learned event shape: `head_a` [hole] `head_b` "token" `tail`."""

    __slots__ = ("count", "head_a", "head_b", "hole", "tail")

    def __init__(self, head: bytes, tail: bytes, count: int) -> None:
        self.head_a = head
        self.hole: bytes | None = None  # b"n" a number, b"s" a string body, None no hole
        self.head_b = b""
        self.tail = tail
        self.count = count  # VISIBLE or REASONING: what one non-empty token string makes

    def match(self, data: bytes) -> int | None:
        """`count` for a non-empty plain token, 0 for an empty one, None when the bytes are not this shape."""
        if not data.startswith(self.head_a) or not data.endswith(self.tail):
            return None
        start = len(self.head_a)
        if self.hole is not None:
            found = (_NUMBER if self.hole == b"n" else _PLAIN_SCALAR).match(data, start)
            if found is None:
                return None
            start = found.end()
            if not data.startswith(self.head_b, start):  # for a string, head_b opens with its closing quote
                return None
            start += len(self.head_b)
        end = len(data) - len(self.tail)
        if end < start or not _body_is_plain(data, start, end):
            return None
        return self.count if end > start else EMPTY


def _token_string(data: bytes, keys: tuple[bytes, ...]) -> tuple[int, int] | None:
    """Where the string after the one key of `keys` present exactly once starts and ends."""
    for key in keys:
        at = data.find(key)
        if at < 0 or data.find(key, at + 1) >= 0:
            continue
        start = at + len(key)
        end = _STRING_BODY.match(data, start)
        if end is not None and data[end.end():end.end() + 1] == b'"':
            return start, end.end()
    return None


class ShapeMemory:
    """What the responses of one dialect taught (see the module's docstring): the shapes the last
    one ended with, and the checks made (the events a check's bytes decode to), the oldest dropped
    past MAX_CHECKS. A shape is never changed once learned, so responses share them."""

    __slots__ = ("_checks", "shapes")

    def __init__(self) -> None:
        self.shapes: tuple[Shape, ...] = ()
        self._checks: dict[bytes, tuple[Event, ...] | None] = {}

    def decodes_to(self, data: bytes, decode: Callable[[bytes], tuple[Event, ...] | None]) -> tuple[Event, ...] | None:
        """`decode(data)`, made once for bytes of at most CHECK_BYTES."""
        checks = self._checks
        if data in checks:
            return checks[data]
        found = decode(data)
        if len(data) <= CHECK_BYTES:
            if len(checks) >= MAX_CHECKS:
                checks.pop(next(iter(checks)), None)
            checks[data] = found
        return found


_MEMORIES: dict[tuple[Interpret, tuple[bytes, ...], tuple[bytes, ...]], ShapeMemory] = {}


def memory_of(interpret: Interpret, keys: tuple[bytes, ...], reasoning_keys: tuple[bytes, ...]) -> ShapeMemory:
    """The memory shared by the responses read with `interpret` and these keys (a dialect's); a
    memory of its own past MAX_MEMORIES of them."""
    key = (interpret, keys, reasoning_keys)
    memory = _MEMORIES.get(key)
    if memory is None:
        memory = ShapeMemory()
        if len(_MEMORIES) < MAX_MEMORIES:
            _MEMORIES[key] = memory
    return memory


class PlainTokens:
    """The learned shapes of one response, and the test an event's bytes are put to."""

    __slots__ = ("_interpret", "_keys", "_learned", "_memory", "_mine", "_only", "_reasoning_keys", "shapes")

    def __init__(self, interpret: Interpret, keys: tuple[bytes, ...], reasoning_keys: tuple[bytes, ...],
                 memory: ShapeMemory | None = None) -> None:
        """`memory`: what earlier responses of the dialect learned, shared (None: this response's own)."""
        self._interpret = interpret
        self._keys = keys
        self._reasoning_keys = reasoning_keys
        self._learned = 0
        self._memory = memory if memory is not None else ShapeMemory()
        # At most SHAPES_PER_KIND for visible tokens and as many for reasoning, the latest first:
        # the last response's, to begin with.
        self.shapes: list[Shape] = list(self._memory.shapes)
        self._mine: list[Shape] = []  # those this response learned: the ones a new shape may merge with
        self._only: tuple[bytes, bytes, int] | None = None  # the first shape, when it has no hole
        self._found_only()

    @property
    def only(self) -> tuple[bytes, bytes, int] | None:
        """(head, tail, kind) of the first shape when it has no hole (the same tuple until it changes)."""
        return self._only

    def inline(self, prefix: bytes) -> tuple[bytes, bytes, int] | None:
        """(prefix + head, tail, kind) of the first shape when it has no hole, for callers that test
        whole ASCII blocks themselves (a body then needs only the UNSAFE search; what fails it goes to
        `count`, which tries every shape); else None."""
        only = self._only
        return None if only is None else (prefix + only[0], only[1], only[2])

    def count(self, data: bytes) -> int:
        """VISIBLE or REASONING for one plain token, EMPTY for an empty one, NOT_PLAIN: decode it."""
        only = self._only
        if only is not None and data.isascii():  # Shape.match's answer for an ASCII body without escapes
            head, tail, kind = only
            start, end = len(head), len(data) - len(tail)
            if (data.startswith(head) and data.endswith(tail) and end >= start
                    and UNSAFE.search(data, start, end) is None):
                return kind if end > start else EMPTY
        for shape in self.shapes:
            found = shape.match(data)
            if found is not None:
                return found
        return NOT_PLAIN

    def decoded(self, data: bytes, events: Sequence[Event]) -> None:
        """An event was decoded into `events`: learn its shape when it is one plain token."""
        if len(events) != 1 or self._learned >= MAX_LEARNED:
            return
        event = events[0]
        if event is ONE_TOKEN:
            keys, kind = self._keys, VISIBLE
        elif event is ONE_REASONING_TOKEN:
            keys, kind = self._reasoning_keys, REASONING
        else:
            return
        span = _token_string(data, keys)
        if span is None:
            return
        self._learned += 1
        head, tail = data[:span[0]], data[span[1]:]
        if _LINE_BREAK.search(head) or _LINE_BREAK.search(tail) or not self._checks(head, tail, event):
            return
        shape = Shape(head, tail, kind)
        shapes = self.shapes
        for old in reversed(self._mine):  # one this response learned that differs in one scalar: a hole there
            if old.count == kind:
                merged = self._with_hole(old, shape)
                if merged is not None:
                    shapes.remove(old)
                    self._mine.remove(old)
                    shape = merged
                    break
        shapes.insert(0, shape)  # the latest first: an answer's usual event is learned after its first
        self._mine.append(shape)
        same = [kept for kept in shapes if kept.count == kind]
        if len(same) > SHAPES_PER_KIND:  # the oldest of its kind goes
            shapes.remove(same[-1])
            if same[-1] in self._mine:
                self._mine.remove(same[-1])
        self._memory.shapes = tuple(shapes)  # (what the next response starts with)
        self._found_only()

    def _found_only(self) -> None:
        only = self.shapes[0] if self.shapes and self.shapes[0].hole is None else None
        self._only = None if only is None else (only.head_a, only.tail, only.count)

    def _decodes_to(self, data: bytes) -> tuple[Event, ...] | None:
        """The events `data` decodes to, as a tuple (to compare with EVENTS), or None: a check's
        bytes, decoded once for the dialect (`ShapeMemory`)."""
        return self._memory.decodes_to(data, self._decode)

    def _decode(self, data: bytes) -> tuple[Event, ...] | None:
        try:
            return tuple(self._interpret(orjson.loads(data)))
        except (ValueError, TypeError, AttributeError):
            return None

    def _checks(self, head: bytes, tail: bytes, event: Event) -> bool:
        """The token string decides: the learned event (a non-empty string) made `event`, and the
        same bytes with the string emptied make none. One decode per shape learned."""
        del event
        return self._decodes_to(head + tail) == ()

    def _with_hole(self, old: Shape, new: Shape) -> Shape | None:
        """When two shapes differ in one scalar of their heads only: one shape with a hole there."""
        if old.hole is not None or old.tail != new.tail:
            return None
        a, b = old.head_a, new.head_a
        same, limit = _common_prefix(a, b), min(len(a), len(b))
        colon = b.rfind(b'":', 0, same + 1)  # the end of the key whose value holds the difference
        if colon < 0 or same == limit:
            return None
        start = colon + 2
        if b[start:start + 1] == b'"':  # a string: the hole is its body
            start += 1
            kind, pattern = b"s", _PLAIN_SCALAR
        else:
            kind, pattern = b"n", _NUMBER
        found_a, found_b = pattern.match(a, start), pattern.match(b, start)
        if found_a is None or found_b is None or a[found_a.end():] != b[found_b.end():]:
            return None
        if a[:start] != b[:start]:
            return None
        shape = Shape(b[:start], new.tail, new.count)
        shape.hole, shape.head_b = kind, b[found_b.end():]
        other = b"0" if kind == b"n" else b""
        if self._decodes_to(shape.head_a + other + shape.head_b + b"x" + shape.tail) != EVENTS[new.count]:
            return None
        return shape
