"""Server-Sent Events framing: bytes in, the `data` payload of each complete event out.

Follows the WHATWG event-stream rules that matter here: `data:` lines of one event are
joined with LF, a blank line dispatches, lines starting with `:` are comments, one space
after the colon is dropped. https://html.spec.whatwg.org/multipage/server-sent-events.html
"""

from __future__ import annotations

from proxy.wire.lines import LineSplitter

DATA = b"data"


class SseDecoder:
    """Yields `(event_name, data)` for each dispatched event that carried data.

    An event whose data lines add up to more than `max_line` is dropped and counted like an
    over-long line: without a blank line an event never ends, and its data must not pile up.
    """

    __slots__ = ("_data", "_event", "_lines", "_max_data", "_oversized", "_size", "_skipping")

    def __init__(self, max_line: int) -> None:
        self._lines = LineSplitter(max_line)
        self._data: list[bytes] = []
        self._event: bytes | None = None
        self._max_data = max_line
        self._size = 0  # bytes in _data
        self._skipping = False  # inside an oversized event, discarding its data until it ends
        self._oversized = 0

    @property
    def overlong_lines(self) -> int:
        return self._lines.overlong + self._oversized

    @property
    def clean(self) -> bool:
        """Between events, nothing held: the next byte starts a new event."""
        return not self._data and self._event is None and not self._skipping and self._lines.clean

    def _add_data(self, value: bytes) -> None:
        if self._skipping:
            return
        self._size += len(value) + 1
        if self._size > self._max_data:
            self._data.clear()
            self._skipping = True
            self._oversized += 1
            return
        self._data.append(value)

    def feed(self, chunk: bytes) -> list[tuple[bytes | None, bytes]]:
        return self._dispatch(self._lines.feed(chunk))

    def close(self) -> list[tuple[bytes | None, bytes]]:
        """Events still open at the end of the stream are discarded, as the spec says."""
        self._dispatch(self._lines.close())
        self._data.clear()
        self._size = 0
        self._skipping = False
        return []

    def _dispatch(self, lines: list[bytes]) -> list[tuple[bytes | None, bytes]]:
        events: list[tuple[bytes | None, bytes]] = []
        for line in lines:
            if not line:
                if self._data:
                    data = self._data[0] if len(self._data) == 1 else b"\n".join(self._data)
                    events.append((self._event, data))
                    self._data.clear()
                self._event = None
                self._size = 0
                self._skipping = False
                continue
            if line[:5] == b"data:":
                value = line[5:]
                self._add_data(value[1:] if value[:1] == b" " else value)
            elif line[:1] == b":":
                continue
            else:
                name, _, value = line.partition(b":")
                if name == b"event":
                    self._event = value[1:] if value[:1] == b" " else value
                elif name == DATA:  # `data` with no colon: an empty data line
                    self._add_data(b"")
        return events
