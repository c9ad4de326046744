"""The total deadline and the idle timeout of one exchange, and the proxy's own shutdown: enforced as
rescheduled asyncio timeouts.

Armed around reads from the upstream only, so a slow client never counts as an idle upstream.
Given what it needs when it is built; it tells what fired through `fired`, never by reaching
into the exchange that uses it. `shutdown()` ends the guarded wait at once, whatever the mode.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from types import TracebackType
from typing import Literal

Kind = Literal["total", "idle"]
Fired = Literal["total", "idle", "shutdown"]

# loop.time() - time.monotonic(), per loop: the largest seen. A loop's time can be the turn's rather
# than the moment's (uvloop's, to the millisecond), so one reading can be behind by as long as the
# turn has run, and a timeout set by it would fire that much early; the largest reading is the
# least behind.
_offsets: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, float] = weakref.WeakKeyDictionary()


def _loop_offset(loop: asyncio.AbstractEventLoop) -> float:
    seen = loop.time() - time.monotonic()
    best = _offsets.get(loop)
    if best is None or seen > best:
        _offsets[loop] = best = seen
    return best


def calibrate(loop: asyncio.AbstractEventLoop) -> None:
    """Read the loop's offset where its clock is fresh: in a timer's callback, which uvloop runs
    first in its turn, right after it read the clock. Called before the first exchange, so that
    its deadline does not rest on one reading taken late in a long turn (a process's first request
    may run tens of milliseconds of first-time imports in its turn): it would fire that much early."""
    loop.call_later(0.001, _loop_offset, loop)  # (a delay of 0 would not be a timer in uvloop)


class Deadlines:
    """`guard()` around the reads; `arm(since)` before each read, `disarm()` after it."""

    __slots__ = ("_armed", "_guarded", "_offset", "_timeout", "deadline_at", "deadline_s", "enforce", "fired",
                 "idle_s", "started")

    def __init__(self, started: float, deadline_s: float, idle_s: float, enforce: bool) -> None:
        self.started = started
        self.deadline_s = deadline_s
        self.idle_s = idle_s or None
        self.enforce = enforce and bool(deadline_s or idle_s)
        self.deadline_at = started + deadline_s if deadline_s else None
        self.fired: Fired | None = None
        self._timeout: asyncio.Timeout | None = None
        self._armed: Kind = "total"  # the limit the timeout is set for: what fired when it fires
        self._guarded: asyncio.Task[object] | None = None  # the task in a guard without a timeout
        self._offset = 0.0  # asyncio timeouts run on loop.time(); our stamps are time.monotonic()

    def guard(self) -> _Guard:
        """The context the guarded waits run in; TimeoutError out of it with `fired` set when a
        limit of ours ended the wait. A TimeoutError of another origin (the upstream pool's connect
        timeout is one) passes through with `fired` unset."""
        return _Guard(self)

    def _at(self, when: float | None) -> float | None:
        return None if when is None else when + self._offset

    def shutdown(self) -> None:
        """The proxy is stopping: end the guarded wait now (or the next one, at its start)."""
        if self.fired == "shutdown":
            return
        timeout = self._timeout
        if timeout is not None and timeout.expired():
            return  # a limit has fired: the wait ends with it, named as what it was
        self.fired = "shutdown"
        if timeout is not None:
            timeout.reschedule(asyncio.get_running_loop().time())
        elif self._guarded is not None:
            self._guarded.cancel()  # its guard turns this cancellation into the TimeoutError

    def arm(self, since: float) -> None:
        """Before a read: the earlier of the total deadline and `since` + the idle timeout."""
        timeout = self._timeout
        # (Fired and not yet taken by the guarded task, a timeout refuses to be moved: a read in
        # the same turn of the loop must leave it be.)
        if timeout is None or not self.enforce or self.fired is not None or timeout.expired():
            return
        when = self.deadline_at
        self._armed = "total"
        if self.idle_s is not None:
            idle_at = since + self.idle_s
            if when is None or idle_at < when:
                when = idle_at
                self._armed = "idle"
        timeout.reschedule(self._at(when))

    def disarm(self) -> None:
        """After a read: only the total deadline runs while the chunk goes to the client."""
        timeout = self._timeout
        if (timeout is not None and self.enforce and self.idle_s is not None and self.fired is None
                and not timeout.expired()):
            self._armed = "total"
            timeout.reschedule(self._at(self.deadline_at))

    def passed(self, ended: float, longest_gap: float) -> Kind | None:
        """Which limit the exchange went past without one being enforced, if any (observe mode)."""
        if self.fired is not None:
            return None
        if self.deadline_s and ended - self.started > self.deadline_s:
            return "total"
        if self.idle_s is not None and longest_gap > self.idle_s:
            return "idle"
        return None

    def message(self) -> str:
        """What the visible end of an enforced cut says."""
        if self.fired == "shutdown":
            return "the proxy is shutting down: this response was ended before it was complete"
        if self.fired == "idle":
            return f"no bytes from the upstream for {self.idle_s:g} s (idle timeout)"
        return f"response exceeded the {self.deadline_s:g} s deadline"


class _Guard:
    """`Deadlines.guard()`: an asyncio timeout rescheduled by `arm`, `disarm` and `shutdown`.

    Where no limit is enforced (observe mode, the default) only a shutdown can end the wait, and
    the guard keeps no timeout: `shutdown` cancels the guarded task, and the guard turns that one
    cancellation into the TimeoutError, as asyncio's timeout does. A plain class rather than a
    generator-based context manager: it is entered twice per request on the forwarding path."""

    __slots__ = ("_cancelling", "_deadlines", "_task", "_timeout")

    def __init__(self, deadlines: Deadlines) -> None:
        self._deadlines = deadlines
        self._timeout: asyncio.Timeout | None = None
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0

    async def __aenter__(self) -> None:
        deadlines = self._deadlines
        if deadlines.fired == "shutdown":
            raise TimeoutError("the proxy is shutting down")
        if not deadlines.enforce:
            task = asyncio.current_task()
            assert task is not None
            self._task = deadlines._guarded = task
            self._cancelling = task.cancelling()
            return
        deadlines._offset = _loop_offset(asyncio.get_running_loop())
        timeout = asyncio.timeout_at(deadlines._at(deadlines.deadline_at))
        deadlines._armed = "total"
        self._timeout = deadlines._timeout = timeout
        await timeout.__aenter__()

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        traceback: TracebackType | None) -> None:
        deadlines, timeout, task = self._deadlines, self._timeout, self._task
        if task is not None:
            deadlines._guarded = None
            if deadlines.fired == "shutdown" and kind is asyncio.CancelledError \
                    and task.uncancel() <= self._cancelling:
                raise TimeoutError("the proxy is shutting down") from error
            return
        assert timeout is not None
        try:
            await timeout.__aexit__(kind, error, traceback)
        except TimeoutError:
            if deadlines.fired is None:
                # The limit it was set for, not a reading of the clock: the loop's time (uvloop's is
                # the turn's, to the millisecond) can fire a timeout before time.monotonic() says
                # the deadline has come.
                deadlines.fired = deadlines._armed
            raise
        finally:
            deadlines._timeout = None
