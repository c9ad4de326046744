"""Incremental, bounded line splitting over arbitrary chunk boundaries.

Accepts LF, CRLF and lone CR line endings (the SSE spec allows all three), including a CRLF
split across two chunks. A line longer than `max_line` is dropped (its bytes were already
forwarded) and reported once, so a 10 MiB line without a newline costs bounded memory.
"""

from __future__ import annotations

_EMPTY: list[bytes] = []


class LineSplitter:
    """Turns byte chunks into complete lines (without their line endings)."""

    __slots__ = ("_buffer", "_cr_pending", "_max_line", "_skipping", "overlong")

    def __init__(self, max_line: int) -> None:
        self._buffer = bytearray()
        self._cr_pending = False  # the previous chunk ended with CR: a leading LF belongs to it
        self._max_line = max_line
        self._skipping = False  # inside an over-long line, discarding until its end
        self.overlong = 0  # over-long lines seen

    @property
    def clean(self) -> bool:
        """Nothing held: the next byte starts a line."""
        return not self._buffer and not self._cr_pending and not self._skipping

    def feed(self, chunk: bytes) -> list[bytes]:
        """The lines that `chunk` completes, in order."""
        if self._cr_pending:
            self._cr_pending = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        if b"\r" in chunk:
            self._cr_pending = chunk[-1:] == b"\r"
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if b"\n" not in chunk:
            self._hold(chunk)
            return _EMPTY
        held = len(self._buffer)
        lines = chunk.split(b"\n")
        tail = lines.pop()
        if self._skipping:
            lines[0] = b""  # the rest of a dropped line; it still ends an event if empty
            self._skipping = False
            del lines[0]
        elif self._buffer:
            self._buffer += lines[0]
            lines[0] = bytes(self._buffer)
            self._buffer.clear()
        if held + len(chunk) > self._max_line:  # only then can a complete line be over the limit
            kept = [line for line in lines if len(line) <= self._max_line]
            self.overlong += len(lines) - len(kept)  # dropped whether it came whole or in pieces
            lines = kept
        self._hold(tail)
        return lines

    def close(self) -> list[bytes]:
        """A final line that had no line ending, if any."""
        rest = bytes(self._buffer)
        self._buffer.clear()
        return [rest] if rest and not self._skipping else _EMPTY

    def _hold(self, part: bytes) -> None:
        if self._skipping or not part:
            return
        if len(self._buffer) + len(part) > self._max_line:
            self._buffer.clear()
            self._skipping = True
            self.overlong += 1
            return
        self._buffer += part
