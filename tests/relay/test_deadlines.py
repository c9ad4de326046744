"""The guard around the upstream waits: a shutdown ends a guarded wait in every mode, a limit only
where it is enforced, and a cancellation that is not ours passes through unchanged."""

from __future__ import annotations

import asyncio
import time
import weakref

import pytest

from proxy.relay import deadlines as deadlines_module
from proxy.relay.deadlines import Deadlines, calibrate


async def _wait_guarded(deadlines: Deadlines, seconds: float) -> None:
    async with deadlines.guard():
        await asyncio.sleep(seconds)


@pytest.mark.parametrize("enforce", [False, True])
async def test_a_shutdown_ends_the_guarded_wait_as_a_timeout(enforce: bool) -> None:
    deadlines = Deadlines(time.monotonic(), 60.0, 0.0, enforce)
    waiting = asyncio.create_task(_wait_guarded(deadlines, 30))
    await asyncio.sleep(0.01)
    deadlines.shutdown()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(waiting, 2)
    assert deadlines.fired == "shutdown"
    assert waiting.cancelling() == 0  # the cancellation was taken back, not left pending


async def test_after_a_shutdown_a_new_guard_refuses_at_once() -> None:
    deadlines = Deadlines(time.monotonic(), 0.0, 0.0, False)
    deadlines.shutdown()
    with pytest.raises(TimeoutError):
        await _wait_guarded(deadlines, 30)


async def test_in_observe_mode_a_limit_never_ends_the_wait() -> None:
    deadlines = Deadlines(time.monotonic(), 0.05, 0.02, False)
    await _wait_guarded(deadlines, 0.1)
    assert deadlines.fired is None
    assert deadlines.passed(time.monotonic(), 0.1) == "total"


async def test_an_enforced_deadline_ends_the_wait_and_says_which() -> None:
    deadlines = Deadlines(time.monotonic(), 0.05, 0.0, True)
    with pytest.raises(TimeoutError):
        await _wait_guarded(deadlines, 5)
    assert deadlines.fired == "total"


@pytest.mark.parametrize("enforce", [False, True])
async def test_a_cancellation_from_elsewhere_stays_a_cancellation(enforce: bool) -> None:
    deadlines = Deadlines(time.monotonic(), 60.0, 0.0, enforce)
    waiting = asyncio.create_task(_wait_guarded(deadlines, 30))
    await asyncio.sleep(0.01)
    waiting.cancel()  # a client that went away: aiohttp cancels the handler
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert deadlines.fired is None


async def test_a_shutdown_beside_a_cancellation_from_elsewhere_leaves_the_cancellation() -> None:
    deadlines = Deadlines(time.monotonic(), 0.0, 0.0, False)
    waiting = asyncio.create_task(_wait_guarded(deadlines, 30))
    await asyncio.sleep(0.01)
    waiting.cancel()
    deadlines.shutdown()
    with pytest.raises(asyncio.CancelledError):
        await waiting


class _LaggingLoopTime:
    """A loop whose time is its turn's, as uvloop's is (its clock is read once per turn): read late
    in a long turn, it lags the moment. The first reading here lags by `lag_s`, the rest not."""

    def __init__(self, loop: asyncio.AbstractEventLoop, lag_s: float) -> None:
        self.lag_s, self.real = lag_s, loop.time

    def __call__(self) -> float:
        lag, self.lag_s = self.lag_s, 0.0
        return self.real() - lag


@pytest.mark.parametrize("idle_s", [0.0, 5.0])
async def test_a_deadline_fired_by_a_lagging_loop_clock_is_still_the_total_deadline(
        idle_s: float, monkeypatch: pytest.MonkeyPatch) -> None:
    # Found by a load test: the timeout fired a little before time.monotonic() reached the
    # deadline, the guard then named it an idle timeout (with none set), and the message of the
    # visible end failed on an idle timeout of None: the client was left waiting.
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(time.monotonic(), 0.05, idle_s, True)
    with pytest.raises(TimeoutError):
        monkeypatch.setattr(loop, "time", _LaggingLoopTime(loop, 0.02))
        async with deadlines.guard():
            deadlines.arm(time.monotonic())
            await asyncio.sleep(5)
    assert deadlines.fired == "total"
    assert deadlines.message() == "response exceeded the 0.05 s deadline"


async def test_an_idle_timeout_fired_is_named_idle_whatever_the_clocks_say() -> None:
    deadlines = Deadlines(time.monotonic(), 60.0, 0.05, True)
    with pytest.raises(TimeoutError):
        async with deadlines.guard():
            deadlines.arm(time.monotonic())
            await asyncio.sleep(5)
    assert deadlines.fired == "idle" and "idle timeout" in deadlines.message()


@pytest.mark.parametrize("poke", ["arm", "disarm", "shutdown"])
async def test_a_read_in_the_turn_the_timeout_fires_leaves_it_be(poke: str) -> None:
    # Found by a load test: a read came in the turn of the loop where the idle timeout fired, before
    # the guarded task took it; re-arming raised in the connection's read callback ("Cannot change
    # state of expiring Timeout"), and asyncio killed the upstream connection with a fatal error.
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(time.monotonic(), 60.0, 0.05, True)
    errors: list[BaseException] = []

    def in_the_same_turn() -> None:
        try:
            if poke == "arm":
                deadlines.arm(time.monotonic())
            elif poke == "disarm":
                deadlines.disarm()
            else:
                deadlines.shutdown()
        except Exception as exc:  # (raised in a callback, it would reach only the loop's handler)
            errors.append(exc)

    with pytest.raises(TimeoutError):
        async with deadlines.guard():
            deadlines.arm(time.monotonic())
            timeout = deadlines._timeout
            assert timeout is not None and timeout.when() is not None
            loop.call_at(timeout.when(), in_the_same_turn)  # (after the timeout's own callback)
            await asyncio.sleep(5)
    assert errors == [] and deadlines.fired == "idle"


async def test_a_first_deadline_read_late_in_a_long_turn_fires_no_earlier_once_calibrated(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Left by the fix above: the offset is the largest reading seen, so a process's first exchange
    # rests on one reading, which a long first turn (first-time imports) makes tens of ms stale.
    # The proxy reads it while its loop is idle, before its port opens.
    loop = asyncio.get_running_loop()
    monkeypatch.setattr(deadlines_module, "_offsets", weakref.WeakKeyDictionary())
    calibrate(loop)
    await asyncio.sleep(0.01)  # (the calibration's timer has run)
    started = time.monotonic()
    deadlines = Deadlines(started, 0.05, 0.0, True)
    with pytest.raises(TimeoutError):
        monkeypatch.setattr(loop, "time", _LaggingLoopTime(loop, 0.03))  # the guard's reading: 30 ms stale
        async with deadlines.guard():
            await asyncio.sleep(5)
    assert time.monotonic() - started >= 0.05 - 0.002  # (uvloop's clock counts milliseconds)
    assert deadlines.fired == "total"


async def test_without_the_calibration_that_first_deadline_would_fire_early(monkeypatch: pytest.MonkeyPatch) -> None:
    # The test above's control: the same stale reading, uncalibrated, fires the deadline 30 ms early.
    loop = asyncio.get_running_loop()
    monkeypatch.setattr(deadlines_module, "_offsets", weakref.WeakKeyDictionary())
    started = time.monotonic()
    deadlines = Deadlines(started, 0.05, 0.0, True)
    with pytest.raises(TimeoutError):
        monkeypatch.setattr(loop, "time", _LaggingLoopTime(loop, 0.03))
        async with deadlines.guard():
            await asyncio.sleep(5)
    assert time.monotonic() - started < 0.05 - 0.01
