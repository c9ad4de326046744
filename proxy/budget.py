"""A process-wide budget of bytes held in memory to read bodies, so many large bodies at once stay bounded.

The proxy holds a request body whole to read what it asks for (and to send it on), and a JSON
response body to read it at its end. Each of those is capped on its own; this caps their sum over
all exchanges. A body that would go past it is still forwarded, unread, and its record says so.
"""

from __future__ import annotations


class ByteBudget:
    """`reserve(n)` takes n bytes if they fit (True) or takes nothing (False); `release(n)` gives back."""

    __slots__ = ("capacity", "refused", "used")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.refused = 0  # reservations refused since start

    def reserve(self, size: int) -> bool:
        if self.used + size > self.capacity:
            self.refused += 1
            return False
        self.used += size
        return True

    def release(self, size: int) -> None:
        self.used = max(0, self.used - size)


UNLIMITED = ByteBudget(1 << 62)
