"""The proxy's admission gate (`serve --max-in-flight N`): at most N generations in flight to the
upstream, the rest waiting in a queue that is fair across clients. Off by default, and then free:
the relay does not call it.

Fair: each client (the record's `client`, told apart by the proxy already) has its own FIFO, and a
free place goes to the clients in turn, so that one client's twenty queued requests hold another's
one back by at most one answer. Bounded: at most `queue_max` waiting (past it a request is refused at
once), each at most `queue_timeout_s` (then refused): the relay answers both 503 with `Retry-After`.
The limit can be changed while it runs (the admin API, for the sweep's second arm): a raised limit
lets waiters in at once, a lowered one lets no one in until enough answers end, and `None` opens
the gate (the waiters go in).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


class Refused(Exception):
    """Not admitted: `reason` is `queue_full` or `queue_timeout` (a bounded set, the metric's label)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class GateSettings:
    max_in_flight: int | None = None  # None: the gate is open
    queue_max: int = 1024
    queue_timeout_s: float | None = None  # None: wait as long as it takes ("no gateway timeouts")


class AdmissionGate:
    def __init__(self, settings: GateSettings = GateSettings(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        self.in_flight = 0
        self._queues: dict[str, deque[asyncio.Future[None]]] = {}
        self._turn: deque[str] = deque()  # clients with waiters, in the order they get the next place
        self.waiting = 0

    @property
    def on(self) -> bool:
        return self.settings.max_in_flight is not None

    def set(self, settings: GateSettings) -> None:
        """New settings, at once: waiters go in as far as the new limit allows."""
        self.settings = settings
        self._let_in()

    async def enter(self, client: str | None) -> float:
        """Wait for a place; returns the seconds waited. Raises Refused; on cancellation (the client
        left) the waiter leaves the queue. Call `leave` once the answer is over."""
        limit = self.settings.max_in_flight
        if limit is None or (self.in_flight < limit and not self.waiting):
            self.in_flight += 1
            return 0.0
        if self.waiting >= self.settings.queue_max:
            raise Refused("queue_full", f"the proxy's admission queue is full ({self.waiting} waiting for "
                                        f"{limit} places, --queue-max {self.settings.queue_max})")
        key = client or ""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
            self._turn.append(key)
        queue.append(waiter)
        self.waiting += 1
        started = self._clock()
        try:
            if self.settings.queue_timeout_s is None:
                await waiter
            else:
                async with asyncio.timeout(self.settings.queue_timeout_s):
                    await waiter
        except TimeoutError:
            self._forget(key, waiter)
            raise Refused("queue_timeout", f"waited {self.settings.queue_timeout_s:g} s in the proxy's admission "
                                           f"queue for one of {limit} places (--queue-timeout)") from None
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.leave()  # let in, and gone at once: the place goes on
            else:
                self._forget(key, waiter)
            raise
        return self._clock() - started

    def leave(self) -> None:
        """An admitted request is over: its place goes to the next client in turn."""
        self.in_flight -= 1
        self._let_in()

    def _forget(self, key: str, waiter: asyncio.Future[None]) -> None:
        queue = self._queues.get(key)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            self.waiting -= 1
            if not queue:
                del self._queues[key]
                self._turn.remove(key)

    def _let_in(self) -> None:
        limit = self.settings.max_in_flight
        while self._turn and (limit is None or self.in_flight < limit):
            key = self._turn.popleft()
            queue = self._queues[key]
            waiter = queue.popleft()
            self.waiting -= 1
            if queue:
                self._turn.append(key)  # its next request waits for the others' turns
            else:
                del self._queues[key]
            if waiter.done():  # cancelled (its client left, or its wait ran out) before its turn came
                continue
            self.in_flight += 1
            waiter.set_result(None)
