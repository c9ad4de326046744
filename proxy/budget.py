"""A process-wide budget of bytes held in memory to read bodies, so many large bodies at once stay bounded.

The proxy holds a request body whole to read what it asks for (and to send it on), and a JSON
response body to read it at its end. Each of those is capped on its own; this caps their sum over
all exchanges. A body that would go past it is still forwarded, unread, and its record says so.
"""

from __future__ import annotations

import contextlib
from array import array
from typing import Any

_USED, _REFUSED = 0, 1


class ByteBudget:
    """`reserve(n)` takes n bytes if they fit (True) or takes nothing (False); `release(n)` gives back.

    With `shared` (a RawArray of two 64-bit integers and a lock, from `shared_budget`), worker
    processes draw on one budget: the bound is the proxy's, not each worker's.
    """

    __slots__ = ("_lock", "_values", "capacity")

    def __init__(self, capacity: int, shared: tuple[Any, Any] | None = None) -> None:
        self.capacity = capacity
        if shared is None:
            self._values: Any = array("q", [0, 0])
            self._lock: Any = contextlib.nullcontext()
        else:
            self._values, self._lock = shared

    @property
    def used(self) -> int:
        return int(self._values[_USED])

    @property
    def refused(self) -> int:
        """Reservations refused since start."""
        return int(self._values[_REFUSED])

    def reserve(self, size: int) -> bool:
        values = self._values
        with self._lock:
            if values[_USED] + size > self.capacity:
                values[_REFUSED] += 1
                return False
            values[_USED] += size
            return True

    def release(self, size: int) -> None:
        values = self._values
        with self._lock:
            values[_USED] = max(0, values[_USED] - size)


def shared_budget(context: Any) -> tuple[Any, Any]:
    """The shared state of a ByteBudget for worker processes: (RawArray of used/refused, Lock)."""
    return context.RawArray("q", 2), context.Lock()


UNLIMITED = ByteBudget(1 << 62)
