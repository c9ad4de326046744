"""Server-Sent Events framing: bytes in, the `data` payload of each complete event out.

Follows the WHATWG event-stream rules that matter here: `data:` lines of one event are
joined with LF, a blank line dispatches, lines starting with `:` are comments, one space
after the colon is dropped. https://html.spec.whatwg.org/multipage/server-sent-events.html
"""

from __future__ import annotations

from proxy.lines import LineSplitter

DATA = b"data"


class SseDecoder:
    """Yields `(event_name, data)` for each dispatched event that carried data."""

    __slots__ = ("_data", "_event", "_lines")

    def __init__(self, max_line: int) -> None:
        self._lines = LineSplitter(max_line)
        self._data: list[bytes] = []
        self._event: bytes | None = None

    @property
    def overlong_lines(self) -> int:
        return self._lines.overlong

    def feed(self, chunk: bytes) -> list[tuple[bytes | None, bytes]]:
        return self._dispatch(self._lines.feed(chunk))

    def close(self) -> list[tuple[bytes | None, bytes]]:
        """Events still open at the end of the stream are discarded, as the spec says."""
        self._dispatch(self._lines.close())
        self._data.clear()
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
                continue
            if line[:5] == b"data:":
                value = line[5:]
                self._data.append(value[1:] if value[:1] == b" " else value)
            elif line[:1] == b":":
                continue
            else:
                name, _, value = line.partition(b":")
                if name == b"event":
                    self._event = value[1:] if value[:1] == b" " else value
                elif name == DATA:  # `data` with no colon: an empty data line
                    self._data.append(b"")
        return events
