"""The queue of records that wait for the server's tokenizer: no record waits past its bound, a
tokenizer that keeps failing is given up on (a breaker) until a trial call succeeds, the calls are
bounded for the whole proxy across worker processes, and a bug with one record costs that record
only."""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import time

from proxy.diagnosis.prompt_rules import PromptCount
from proxy.diagnosis.tokenizer_queue import CallGate, QueueLimits, TokenizerQueue
from proxy.record import ResponseRecord
from proxy.serve.shared import SharedState
from proxy.servers.base import ServerIdentity, ServerInfo, TokenizerQuery, TokenizerUnavailable

FACTS = ServerIdentity("vllm", None, {"m": ServerInfo("vLLM GET /v1/models", 512)})


class Tokenizer:
    """Answers after `delay` (or fails while `failing`); records when each call started."""

    def __init__(self, delay: float = 0.0, failing: bool = False) -> None:
        self.delay, self.failing = delay, failing
        self.started: list[float] = []
        self.running = self.peak = 0

    async def count(self, query: TokenizerQuery, identity: ServerIdentity,
                    authorization: str | None = None) -> PromptCount:
        self.started.append(time.monotonic())
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(self.delay)
            if self.failing:
                raise TokenizerUnavailable("POST /tokenize answered 500")
            return PromptCount(10, 512, "test tokenizer")
        finally:
            self.running -= 1


def pending(i: int) -> tuple[ResponseRecord, TokenizerQuery, None]:
    record = ResponseRecord(request_id=f"r{i}", method="POST", path="/v1/chat/completions",
                            route="/v1/chat/completions", dialect="openai", started_at=0.0, model="m", status=200,
                            stop_reason="length", length_cause="unknown", length_cause_source="counted",
                            output_tokens=30, tokens_source="counted", requested_max_tokens=40)
    return record, TokenizerQuery("openai", "/v1/chat/completions", "m", b"{}", 40, None), None


async def until(condition: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


async def test_no_record_waits_past_its_bound_whatever_the_tokenizer_does() -> None:
    """A tokenizer that never answers held each record its full 5 s turn, two at a time: ten records
    were still missing 17 s after their answers ended. Now each goes on within its bound."""
    delivered: list[tuple[float, ResponseRecord]] = []
    results: list[str] = []
    queue = TokenizerQueue(Tokenizer(delay=60.0), lambda: FACTS, lambda r: delivered.append((time.monotonic(), r)),
                           QueueLimits(max_wait_s=0.5, timeout_s=5.0, rate_per_s=1000.0), on_result=results.append)
    queue.start()
    put_at = time.monotonic()
    for i in range(10):
        queue.put(*pending(i))
    await until(lambda: len(delivered) == 10, 3.0)
    await queue.close()
    assert max(at for at, _ in delivered) - put_at < 0.5 + 0.4  # the bound, and the reaper's turn
    assert all("within 0.5 s" in (r.length_cause_detail or "") for _, r in delivered)
    assert results == ["timeout"] * 10


async def test_after_failures_in_a_row_records_go_on_at_once_until_a_probe_succeeds() -> None:
    tokenizer = Tokenizer(failing=True)
    delivered: list[ResponseRecord] = []
    results: list[str] = []
    limits = QueueLimits(breaker_failures=3, breaker_retry_s=0.3, rate_per_s=1000.0)
    queue = TokenizerQueue(tokenizer, lambda: FACTS, delivered.append, limits, on_result=results.append)
    queue.start()
    for i in range(3):
        queue.put(*pending(i))
    await until(lambda: len(delivered) == 3)
    assert queue.breaker_open and results == ["failed"] * 3
    # Open: the next ones go on at once, undecided, without a call.
    calls = len(tokenizer.started)
    for i in range(3, 6):
        queue.put(*pending(i))
    assert len(delivered) == 6 and len(tokenizer.started) == calls
    assert all("failed 3 times in a row" in (r.length_cause_detail or "") for r in delivered[3:])
    assert results[3:] == ["breaker_open"] * 3
    # After the retry period one record is the trial; the server answers again: closed.
    await asyncio.sleep(0.35)
    tokenizer.failing = False
    queue.put(*pending(6))
    queue.put(*pending(7))  # while the trial is out: at once
    await until(lambda: len(delivered) == 8)
    assert not queue.breaker_open
    assert [r.request_id for r in delivered[6:]] == ["r7", "r6"] and delivered[-1].length_cause == "requested_budget"
    queue.put(*pending(8))
    await until(lambda: len(delivered) == 9)
    await queue.close()
    assert delivered[-1].length_cause == "requested_budget"


async def test_the_calls_are_bounded_for_the_whole_proxy_across_workers() -> None:
    """Two workers' queues on one shared gate: 2 calls at once and 10 a second in all (each worker's
    share of 1 rounded up let 3 run at once with --workers 3)."""
    state = SharedState.allocate(multiprocessing.get_context("spawn")).gate
    tokenizers = [Tokenizer(delay=0.05), Tokenizer(delay=0.05), Tokenizer(delay=0.05)]
    delivered: list[ResponseRecord] = []
    running = [0]
    peak = [0]

    class Watched(Tokenizer):
        async def count(self, query: TokenizerQuery, identity: ServerIdentity,
                        authorization: str | None = None) -> PromptCount:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            try:
                return await super().count(query, identity, authorization)
            finally:
                running[0] -= 1

    watched = [Watched(0.05) for _ in tokenizers]
    queues = [TokenizerQueue(tokenizer, lambda: FACTS, delivered.append, QueueLimits(in_flight=2, rate_per_s=10.0),
                             gate=CallGate(2, 10.0, shared=state, owner=1 + n)) for n, tokenizer in enumerate(watched)]
    for queue in queues:
        queue.start()
    for i in range(12):
        queues[i % 3].put(*pending(i))
    await until(lambda: len(delivered) == 12, 5.0)
    for queue in queues:
        await queue.close()
    starts = sorted(t for tokenizer in watched for t in tokenizer.started)
    assert peak[0] <= 2
    assert max(sum(1 for t in starts if at <= t < at + 1.0) for at in starts) <= 10
    assert all(b - a >= 0.09 for a, b in itertools.pairwise(starts))  # spaced, from the first


async def test_a_bug_with_one_record_costs_that_record_only() -> None:
    delivered: list[ResponseRecord] = []
    lost: list[int] = []

    def deliver(record: ResponseRecord) -> None:
        if record.request_id == "r0":
            raise TypeError("a record the diagnosis could not write")
        delivered.append(record)

    queue = TokenizerQueue(Tokenizer(), lambda: FACTS, deliver, QueueLimits(rate_per_s=1000.0),
                           on_lost=lambda: lost.append(1))
    queue.start()
    for i in range(3):
        queue.put(*pending(i))
    await until(lambda: len(delivered) == 2)
    await queue.close()
    # (Calls run side by side, IN_FLIGHT at a time: the two left may end in either order.)
    assert sorted(r.request_id for r in delivered) == ["r1", "r2"] and lost == [1]


def test_the_gate_holds_one_call_at_first_and_gives_back_a_dead_workers_calls() -> None:
    now = [100.0]
    gate = CallGate(in_flight=2, rate_per_s=10.0, clock=lambda: now[0])
    assert gate.try_acquire() == 0.0
    assert gate.try_acquire() > 0  # no second call at once: the bucket holds one
    now[0] += 0.1
    assert gate.try_acquire() == 0.0 and gate.calls == 2
    now[0] += 1.0
    assert gate.try_acquire() > 0  # two in flight
    gate.forget(0)
    assert gate.try_acquire() == 0.0
