"""A small progress bar on stderr: redrawn in place on a terminal, one line per level otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 30
REDRAW_INTERVAL_S = 0.1


class ProgressBar:
    """Counts finished responses of the whole sweep; `level_done` marks the end of a level."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.level: int | None = None
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.interactive = enabled and self.stream.isatty()
        self._drawn_at = 0.0

    def start_level(self, level: int) -> None:
        self.level = level
        self._draw(force=True)

    def advance(self) -> None:
        self.done += 1
        self._draw(force=self.done == self.total)

    def level_done(self, level: int, responses: int, seconds: float) -> None:
        if not self.enabled:
            return
        if self.interactive:
            self.stream.write("\r\x1b[2K")
        self.stream.write(f"concurrency {level}: {responses} responses in {seconds:.1f}s\n")
        self.stream.flush()
        self._draw(force=True)

    def close(self) -> None:
        if self.interactive:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()

    def _draw(self, force: bool) -> None:
        if not self.interactive:
            return
        now = time.monotonic()
        if not force and now - self._drawn_at < REDRAW_INTERVAL_S:
            return
        self._drawn_at = now
        filled = BAR_WIDTH * self.done // self.total
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        where = f" concurrency {self.level}" if self.level is not None else ""
        self.stream.write(f"\r[{bar}] {self.done}/{self.total}{where}")
        self.stream.flush()
