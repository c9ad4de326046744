"""Records that wait for the server's tokenizer before they go on: a bounded queue, a gate on the
calls, a breaker, and a bound on every record's wait.

A length stop whose tokens were only counted waits for the server's own tokenizer to count its
prompt (proxy.diagnosis.server_check). Nothing of it may hold a client's bytes, and nothing may hold
a record long:
- the queue holds at most `queue_max` records and `queue_bytes` of their request bodies; past it a
  record goes on at once, undecided (`dropped`);
- the calls pass a gate (`CallGate`): at most `in_flight` at once and one every 1/`rate_per_s`
  seconds, for the whole proxy (with `--workers N` the gate's state is shared by every worker): a
  burst of records never becomes a burst of calls, not even the first;
- a record waits at most `max_wait_s` from the moment it is queued, its call included: a record
  past it goes on undecided (`timeout`), whatever the server does;
- a breaker: after `breaker_failures` calls in a row that failed or timed out, records go on at
  once, undecided (`breaker_open`), and every `breaker_retry_s` one is let through as a trial;
  the first call that succeeds closes it. One log line when it opens, one when it closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import structlog

from proxy.diagnosis.delivery import LostRecords
from proxy.diagnosis.recorder import Recorder
from proxy.processes import OWNERS
from proxy.record import ResponseRecord
from proxy.servers.base import PromptCount, ServerIdentity, TokenizerQuery, TokenizerUnavailable

_log = structlog.get_logger("llm_diag_proxy.server")

QUEUE_MAX = 1_000
QUEUE_BYTES = 32 * 1024 * 1024
IN_FLIGHT = 2
RATE_PER_S = 20.0
TIMEOUT_S = 5.0  # one call
MAX_WAIT_S = 10.0  # one record, from its queueing to its delivery
BREAKER_FAILURES = 5
BREAKER_RETRY_S = 10.0
REAP_EVERY_S = 0.25
_ALLOWANCE, _REFILLED = range(2)


class CountsPrompts(Protocol):
    """The server's tokenizer (`proxy.diagnosis.server_check.ServerTokenizer`)."""

    async def count(self, query: TokenizerQuery, identity: ServerIdentity, client_authorization: str | None = None,
                    ) -> PromptCount: ...


@dataclass(frozen=True, slots=True)
class QueueLimits:
    """How much the proxy asks of its upstream's tokenizer, and how long a record may wait for it."""

    queue_max: int = QUEUE_MAX
    queue_bytes: int = QUEUE_BYTES
    in_flight: int = IN_FLIGHT
    rate_per_s: float = RATE_PER_S
    timeout_s: float = TIMEOUT_S
    max_wait_s: float = MAX_WAIT_S
    breaker_failures: int = BREAKER_FAILURES
    breaker_retry_s: float = BREAKER_RETRY_S

    def share(self, workers: int) -> QueueLimits:
        """This process's part of the queue when `workers` processes each keep one (the calls are
        bounded for the whole proxy by a shared CallGate, not shared out)."""
        if workers <= 1:
            return self
        return replace(self, queue_max=max(1, self.queue_max // workers),
                       queue_bytes=max(1 << 20, self.queue_bytes // workers))


DEFAULT_LIMITS = QueueLimits()


class CallGate:
    """At most `in_flight` calls at once and `rate_per_s` a second: a token bucket that holds one
    call, so the calls are spaced (no burst, even at the start). `shared` (`proxy.serve.shared`) makes
    the bounds the whole proxy's across worker processes; `owner` is this process's slot in it."""

    def __init__(self, in_flight: int = IN_FLIGHT, rate_per_s: float = RATE_PER_S,
                 shared: tuple[Any, Any, Any] | None = None, owner: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.in_flight, self.rate_per_s = in_flight, rate_per_s
        self._owner, self._clock = owner, clock
        if shared is None:
            self._calls: Any = array("q", bytes(8 * OWNERS))
            self._bucket: Any = array("d", [1.0, clock()])
            self._lock: Any = contextlib.nullcontext()
        else:
            self._calls, self._bucket, self._lock = shared

    def try_acquire(self) -> float:
        """Take a call (0.0), or the seconds until one might be had."""
        with self._lock:
            if sum(self._calls) >= self.in_flight:
                return 0.02
            now = self._clock()
            bucket = self._bucket
            allowance = min(1.0, bucket[_ALLOWANCE] + (now - bucket[_REFILLED]) * self.rate_per_s)
            bucket[_REFILLED] = now
            if allowance < 1.0 - 1e-9:  # (a whole call's time since the last: a float's rounding aside)
                bucket[_ALLOWANCE] = allowance
                return float((1.0 - allowance) / self.rate_per_s)
            bucket[_ALLOWANCE] = max(0.0, allowance - 1.0)
            self._calls[self._owner] += 1
        return 0.0

    def release(self) -> None:
        with self._lock:
            self._calls[self._owner] = max(0, self._calls[self._owner] - 1)

    def forget(self, owner: int) -> None:
        """A dead worker's calls, given back (the supervisor, when a worker dies)."""
        with self._lock:
            self._calls[owner] = 0

    @property
    def calls(self) -> int:
        """Calls in flight now, every process's."""
        return int(sum(self._calls))


@dataclass(slots=True)
class _Waiting:
    record: ResponseRecord
    query: TokenizerQuery
    authorization: str | None
    size: int
    deadline: float  # monotonic: when it goes on, decided or not
    trial: bool = False  # the breaker's trial call


class TokenizerQueue:
    """Holds each record that needs the server's tokenizer until it answers (bounded in count, bytes
    and time), then hands it on to `deliver`, decided or with the reason it was not."""

    def __init__(self, tokenizer: CountsPrompts, identity: Callable[[], ServerIdentity],
                 deliver: Callable[[ResponseRecord], None], limits: QueueLimits = QueueLimits(), *,
                 gate: CallGate | None = None, identity_known: asyncio.Event | None = None,
                 on_result: Callable[[str], None] = lambda result: None,
                 on_lost: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.monotonic) -> None:
        self._tokenizer = tokenizer
        self._identity = identity
        self._identity_known = identity_known  # set once the server was first asked who it is (None: never)
        self._deliver = deliver
        self._limits = limits
        self._gate = gate or CallGate(limits.in_flight, limits.rate_per_s, clock=clock)
        self._on_result = on_result
        self._lost = LostRecords(on_lost)
        self._clock = clock
        self._queue: deque[_Waiting] = deque()
        self._bytes = 0
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._busy = 0
        self._closed = False
        self._failures = 0  # calls in a row that failed
        self._open_since: float | None = None  # the breaker: open since then (monotonic), None while closed
        self._trying = False
        self._logged: set[str] = set()

    @property
    def breaker_open(self) -> bool:
        return self._open_since is not None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._work(), name=f"server-tokenizer-{i}")
                       for i in range(self._limits.in_flight)]
        self._tasks.append(loop.create_task(self._reap(), name="server-tokenizer-reaper"))

    def put(self, record: ResponseRecord, query: TokenizerQuery, authorization: str | None) -> None:
        """A record that waits for the tokenizer, or goes on at once, undecided, with the reason."""
        if self._closed:
            self._give_up(record, query, "the proxy is stopping", "skipped")
            return
        now = self._clock()
        trial = False
        if self._open_since is not None:
            if self._trying or now - self._open_since < self._limits.breaker_retry_s:
                self._give_up(record, query, f"the server's tokenizer failed {self._limits.breaker_failures} times "
                              "in a row; records go on at once until a call succeeds again", "breaker_open")
                return
            trial = self._trying = True
        size = len(query.body)
        if len(self._queue) >= self._limits.queue_max or self._bytes + size > self._limits.queue_bytes:
            self._trying = self._trying and not trial
            self._give_up(record, query, "too many records were waiting for the server's tokenizer", "dropped")
            return
        self._queue.append(_Waiting(record, query, authorization, size, now + self._limits.max_wait_s, trial))
        self._bytes += size
        self._wake.set()

    async def close(self, timeout_s: float = 2.0) -> None:
        """Stop taking records; give those in flight `timeout_s`, then hand on every one left, undecided."""
        self._closed = True
        deadline = self._clock() + timeout_s
        while (self._queue or self._busy) and self._clock() < deadline:
            await asyncio.sleep(0.02)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        while self._queue:
            waiting = self._take_now()
            self._give_up(waiting.record, waiting.query, "the proxy stopped before the server's tokenizer answered",
                          "skipped")

    # --- the workers ------------------------------------------------------------------------------
    def _take_now(self) -> _Waiting:
        waiting = self._queue.popleft()
        self._bytes -= waiting.size
        return waiting

    async def _work(self) -> None:
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            waiting = self._take_now()
            self._busy += 1
            try:
                await self._settle(waiting)
            except asyncio.CancelledError:
                self._give_up(waiting.record, waiting.query,
                              "the proxy stopped before the server's tokenizer answered", "skipped")
                raise
            except Exception as exc:  # a bug with one record: it is lost (counted, said), the worker goes on
                self._lost.failed(exc)
            finally:
                self._busy -= 1

    async def _reap(self) -> None:
        """Hand on, undecided, the records that waited their whole bound in the queue (the calls ahead
        of them hung): the bound holds whatever the server does."""
        while True:
            await asyncio.sleep(REAP_EVERY_S)
            now = self._clock()
            while self._queue and self._queue[0].deadline <= now:
                waiting = self._take_now()
                self._outwaited(waiting)

    def _outwaited(self, waiting: _Waiting) -> None:
        if waiting.trial:
            self._trying = False
        self._give_up(waiting.record, waiting.query, f"no answer from the server's tokenizer within "
                      f"{self._limits.max_wait_s:g} s of the answer's end", "timeout")

    async def _settle(self, waiting: _Waiting) -> None:
        while (pause := self._gate.try_acquire()) > 0:
            if self._clock() + pause >= waiting.deadline:
                self._outwaited(waiting)
                return
            await asyncio.sleep(pause)
        try:
            left = waiting.deadline - self._clock()
            timeout = min(self._limits.timeout_s, left)
            if timeout <= 0:
                self._outwaited(waiting)
                return
            try:
                async with asyncio.timeout(timeout):
                    if self._identity_known is not None:  # a record that came before the server was first asked
                        await self._identity_known.wait()
                    count = await self._tokenizer.count(waiting.query, self._identity(), waiting.authorization)
            except TimeoutError:
                said = (f"no answer within {self._limits.timeout_s:g} s" if timeout >= self._limits.timeout_s else
                        f"no answer within {self._limits.max_wait_s:g} s of the answer's end")
                raise TokenizerUnavailable(said, "timeout") from None
        except TokenizerUnavailable as exc:
            self._failed(exc, waiting.trial)
            self._settled(waiting, None, f"not decided: the server's tokenizer could not count the prompt: {exc}")
            self._on_result(exc.result)
            return
        finally:
            self._gate.release()
        self._succeeded()
        self._settled(waiting, count, None)
        self._on_result("decided" if waiting.record.length_cause != "unknown" else "undecided")

    def _settled(self, waiting: _Waiting, count: PromptCount | None, note: str | None) -> None:
        Recorder.settle_length(waiting.record, waiting.query, self._identity().kind, count, note)
        self._deliver(waiting.record)

    def _give_up(self, record: ResponseRecord, query: TokenizerQuery, why: str, result: str) -> None:
        try:
            Recorder.settle_length(record, query, self._identity().kind, None, f"not decided: {why}")
            self._on_result(result)
            self._deliver(record)
        except Exception as exc:
            self._lost.failed(exc)

    # --- the breaker ------------------------------------------------------------------------------
    def _failed(self, exc: TokenizerUnavailable, trial: bool) -> None:
        self._note_failure(exc)
        self._failures += 1
        if trial:
            self._trying = False
            self._open_since = self._clock()  # still failing: the next trial after another retry period
            return
        if self._open_since is None and self._failures >= self._limits.breaker_failures:
            self._open_since = self._clock()
            _log.warning("server_tokenizer_breaker_open", failures=self._failures, retry_s=self._limits.breaker_retry_s,
                         note="length stops whose tokens were only counted go on at once, undecided, until a "
                              "call succeeds again")
            while self._queue:  # those waiting go on now, as the next ones will
                waiting = self._take_now()
                self._give_up(waiting.record, waiting.query, f"the server's tokenizer failed {self._failures} times "
                              "in a row; records go on at once until a call succeeds again", "breaker_open")

    def _succeeded(self) -> None:
        self._failures = 0
        if self._open_since is not None:
            self._open_since, self._trying = None, False
            _log.info("server_tokenizer_breaker_closed", note="the server's tokenizer answers again")

    def _note_failure(self, exc: TokenizerUnavailable) -> None:
        """One log line per kind of failure, not one per record."""
        key = str(exc).split(":")[0][:80]
        if key not in self._logged and len(self._logged) < 32:
            self._logged.add(key)
            _log.warning("server_tokenizer_unavailable", reason=str(exc)[:200],
                         note="length stops whose tokens were only counted keep the cause unknown")
