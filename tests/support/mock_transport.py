"""A transport with no socket under it, for driving a protocol with bytes (as httpcore's mock
stream does): what the protocol writes is kept, and the test feeds it what the peer sends."""

from __future__ import annotations

import asyncio
from typing import Any


class MockTransport(asyncio.Transport):
    def __init__(self, sock: Any = None) -> None:
        super().__init__()
        self.sock = sock
        self.written = bytearray()
        self.writes: list[bytes] = []  # each write, as it was made
        self.closed = False
        self.reading = True
        self.protocol: Any = None  # set by the protocol's owner, as a loop's transport has it

    def set_protocol(self, protocol: Any) -> None:
        self.protocol = protocol

    def get_protocol(self) -> Any:
        return self.protocol

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.sock if name == "socket" else default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

    def get_write_buffer_size(self) -> int:
        return 0
