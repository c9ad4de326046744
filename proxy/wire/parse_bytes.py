"""The bytes held in memory to read bodies, bounded process-wide, so many large bodies at once stay bounded.

The proxy holds a request body whole to read what it asks for (and to send it on), and a JSON
response body to read it at its end. Each of those is capped on its own; this caps their sum over
all exchanges (`--parse-bytes`). A body that would go past it is still forwarded, unread, and its
record says so.
"""

from __future__ import annotations

import contextlib
from array import array
from typing import Any

from proxy.processes import OWNERS


class ParseBytes:
    """`reserve(n)` takes n bytes if they fit (True) or takes nothing (False); `release(n)` gives back.

    With `shared` (per-process shares of the bytes held, a refusal count and a lock the kernel drops
    when its holder dies: `proxy.serve.shared`), worker processes draw on one bound: the proxy's, not
    each worker's, and a dead worker's share can be given back (`forget`).
    """

    __slots__ = ("_lock", "_owner", "_refused", "_shares", "capacity")

    def __init__(self, capacity: int, shared: tuple[Any, Any, Any] | None = None, owner: int = 0) -> None:
        self.capacity = capacity
        self._owner = owner
        if shared is None:
            self._shares: Any = array("q", bytes(8 * OWNERS))
            self._refused: Any = array("q", [0])
            self._lock: Any = contextlib.nullcontext()
        else:
            self._shares, self._refused, self._lock = shared

    @property
    def used(self) -> int:
        return int(sum(self._shares))

    @property
    def refused(self) -> int:
        """Reservations refused since start."""
        return int(self._refused[0])

    def reserve(self, size: int) -> bool:
        shares = self._shares
        with self._lock:
            if sum(shares) + size > self.capacity:
                self._refused[0] += 1
                return False
            shares[self._owner] += size
            return True

    def release(self, size: int) -> None:
        shares = self._shares
        with self._lock:
            shares[self._owner] = max(0, shares[self._owner] - size)

    def forget(self, owner: int) -> int:
        """Give back what a dead process held (the supervisor, when a worker dies); returns the bytes."""
        with self._lock:
            held = int(self._shares[owner])
            self._shares[owner] = 0
        return held


UNLIMITED = ParseBytes(1 << 62)
