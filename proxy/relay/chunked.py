"""A chunked body (RFC 9112 section 7.1) read as it passes, so that it can be relayed as it came.

The relay passes a chunked answer's framing through unchanged: the bytes the client gets are the
bytes the server sent, and a read that holds one whole chunk (what servers write per token) is
checked with one match and passed on whole. What is checked is what keeps the framing sound for
the client: hex sizes of at most 16 digits, extensions without control bytes, a CRLF after each
chunk's data, bounded lines. A size line split between reads is held until it is whole; the last
chunk and its trailer section are held to the end and relayed as the relay always has: the last
chunk, and the trailer fields when they are well-formed (`http1.trailer_section`), else none.
"""

from __future__ import annotations

import re

from proxy.relay.http1 import trailer_section

MAX_LINE = 8190  # a chunk-size or trailer line, as aiohttp's parser bounds a line of the head
MAX_ENDING = 65536  # the last chunk and its trailer section
_HEX_DIGITS = b"0123456789abcdefABCDEF"
_SIZE_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})(?:[\t ]*;[\t\x20-\x7e\x80-\xff]*)?\r\n")
_SIZE, _DATA, _CRLF, _ENDING = range(4)


# Chunk sizes read so far, by their size line: a server's chunks are a few hundred bytes long, so
# a handful of lines recur in every stream, and a dict lookup is a fifth of what reading the hex
# costs (`int(line, 16)` alone is most of it). Bounded: past SIZE_LINES_KEPT lines the rest are
# read each time.
SIZE_LINES_KEPT = 4096
_SIZE_LINES: dict[bytes, int] = {}


def chunk_start(data: bytes) -> int:
    """Where the payload of `data` starts when `data` is one whole chunk and nothing else (what a
    server writes per token), read between chunks it leaves the framing where it was; else 0. The
    payload is `data[start:-2]`.

    Bytes methods and a dict, no pattern match, no copy: it runs once per event."""
    line = data.find(b"\r\n", 0, 18)  # a size of 1 to 16 hex digits, no extension
    if line <= 0:
        return 0
    size_line = data[:line]
    size = _SIZE_LINES.get(size_line)
    if size is None:
        if size_line.strip(_HEX_DIGITS):  # something else than hex digits in it
            return 0
        size = int(size_line, 16)
        if len(_SIZE_LINES) < SIZE_LINES_KEPT:
            _SIZE_LINES[size_line] = size
    if size and len(data) == line + size + 4 and data.endswith(b"\r\n"):
        return line + 2
    return 0


def one_chunk(data: bytes) -> bytes | None:
    """The payload of `data` when it is one whole chunk (`chunk_start`), else None."""
    start = chunk_start(data)
    return data[start:-2] if start else None


class FramingError(Exception):
    """The body is not valid chunked framing, from offset `at` of the read that held it: `relayable`
    is what came before the fault in that read, as it came, and `pieces` its payload."""

    def __init__(self, message: str, at: int = 0) -> None:
        super().__init__(message)
        self.at = at
        self.relayable = b""
        self.pieces: list[bytes] = []


class ChunkedBody:
    """`feed(read)` per read: (what to relay now, as it came; the payload pieces in it). After the
    end, `done` is set, `ending()` is what ends the relayed body, and `extra` says bytes followed
    it on the connection (which then carries nothing more)."""

    __slots__ = ("_held", "_need", "_state", "between_chunks", "done", "extra")

    def __init__(self) -> None:
        self._state = _SIZE
        self._need = 0  # bytes of data, or of the CRLF after it, still to come
        self._held = b""  # an unfinished line; from the last chunk on, everything
        self.done = False
        self.extra = False
        self.between_chunks = True  # nothing of a chunk is open: a read may be one whole chunk (`one_chunk`)

    def feed(self, data: bytes) -> tuple[bytes, list[bytes]]:
        if self._state == _SIZE and not self._held:  # a read of one whole chunk, the usual one
            payload = one_chunk(data)
            if payload is not None:
                return data, [payload]
        return self._feed(data)

    def ending(self) -> bytes:
        """The last chunk, with the trailer fields when they are well-formed."""
        fields = trailer_section(self._held)
        return b"0\r\n" + fields + b"\r\n" if fields is not None else b"0\r\n\r\n"

    def _feed(self, data: bytes) -> tuple[bytes, list[bytes]]:
        out: list[bytes] = []
        pieces: list[bytes] = []
        size = len(data)
        pos = 0
        if self._state == _SIZE and not self._held:  # whole chunks one after another: a fast server's read
            size_line = _SIZE_LINE.match
            while (found := size_line(data, pos)) is not None:
                start = found.end()
                end = start + int(found.group(1), 16)
                if end == start or end + 2 > size or data[end] != 13 or data[end + 1] != 10:
                    break  # the last chunk, or one this read does not hold whole: the way below
                pieces.append(data[start:end])
                pos = end + 2
        mark = 0 if self._state != _ENDING else size  # data[mark:pos] is to be relayed, not yet in `out`
        try:
            pos, mark = self._frames(data, pos, mark, out, pieces)
        except FramingError as exc:
            exc.relayable = b"".join(out) + data[mark:max(mark, exc.at)]
            exc.pieces = pieces
            raise
        self.between_chunks = self._state == _SIZE and not self._held
        if mark < pos:
            out.append(data[mark:pos])
        if self.done and pos < size:
            self.extra = True
        return b"".join(out), pieces

    def _frames(self, data: bytes, pos: int, mark: int, out: list[bytes], pieces: list[bytes]) -> tuple[int, int]:
        """The general way, from `pos`: (where it stopped, where the bytes not yet in `out` start)."""
        size = len(data)
        while pos < size and not self.done:
            state = self._state
            if state == _DATA:
                take = min(self._need, size - pos)
                pieces.append(data[pos:pos + take])
                pos += take
                self._need -= take
                if not self._need:
                    self._state, self._need = _CRLF, 2
            elif state == _CRLF:
                while self._need and pos < size:
                    if data[pos] != (13 if self._need == 2 else 10):
                        raise FramingError("chunk data not followed by CRLF", pos)
                    pos += 1
                    self._need -= 1
                if not self._need:
                    self._state = _SIZE
            else:
                newline = data.find(b"\n", pos)
                if newline < 0:
                    if state == _SIZE:
                        out.append(data[mark:pos])
                        mark = size
                    self._held += data[pos:]
                    self._bound()
                    pos = size
                    break
                line_end = newline + 1
                if state == _ENDING:
                    line = data[pos:line_end]
                    whole = self._held[self._held.rfind(b"\n") + 1:] + line
                    self._held += line
                    self._bound()
                    pos = line_end
                    if whole == b"\r\n":
                        self.done = True
                    continue
                line = self._held + data[pos:line_end]
                match = _SIZE_LINE.fullmatch(line)
                if match is None:
                    raise FramingError("invalid chunk size line", pos)
                out.append(data[mark:pos])
                if int(match.group(1), 16) == 0:  # the last chunk: held, with its trailers, to the end
                    self._state, self._held = _ENDING, line
                    mark = size
                else:
                    out.append(self._held)  # the part of the line an earlier read held, if any
                    self._state, self._need, self._held = _DATA, int(match.group(1), 16), b""
                    mark = pos
                pos = line_end
        return pos, mark

    def _bound(self) -> None:
        if len(self._held) > (MAX_ENDING if self._state == _ENDING else MAX_LINE):
            raise FramingError("chunk size line or trailer section too long")
