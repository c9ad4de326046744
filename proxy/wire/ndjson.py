"""Newline-delimited JSON framing (Ollama's native streaming): bytes in, non-blank lines out."""

from __future__ import annotations

from proxy.wire.lines import LineSplitter


class NdjsonDecoder:
    """Yields each complete non-blank line; a last line without newline is yielded at close."""

    __slots__ = ("_lines",)

    def __init__(self, max_line: int) -> None:
        self._lines = LineSplitter(max_line)

    @property
    def overlong_lines(self) -> int:
        return self._lines.overlong

    @property
    def clean(self) -> bool:
        return self._lines.clean

    def feed(self, chunk: bytes) -> list[bytes]:
        return [line for line in self._lines.feed(chunk) if line.strip()]

    def close(self) -> list[bytes]:
        return [line for line in self._lines.close() if line.strip()]
