"""Delivery in batches: a finished record is final before it waits, waits at most `batch_s` (less
once FULL_BATCH wait with it; past MAX_WAITING the oldest goes at once), reaches every observer in
the order records finished, and is never missing from what is read through `flush()`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from structlog.testing import capture_logs

from proxy.diagnosis import delivery as delivery_module
from proxy.diagnosis.delivery import FULL_BATCH, MAX_WAITING, Delivery
from proxy.observers.hooks import Enricher, Observer
from proxy.record import ResponseRecord, ServerDuring


def _record(request_id: str) -> ResponseRecord:
    return ResponseRecord(request_id=request_id, method="POST", path="/v1/chat/completions", route="chat",
                          dialect="openai", started_at=0.0)


class Seen(Observer):
    def __init__(self) -> None:
        self.ids: list[str] = []

    def on_response(self, record: ResponseRecord) -> None:
        self.ids.append(record.request_id)


class Failing(Observer):
    def on_response(self, record: ResponseRecord) -> None:
        raise RuntimeError("observer broke")


class Facts(Enricher):
    """The facts of the moment the record finished: a later read would see other ones."""

    def __init__(self) -> None:
        self.now = 1.0

    def during(self, record: ResponseRecord) -> ServerDuring:
        return {"upstream_running_max": self.now}


async def test_a_record_waits_for_its_batch_then_reaches_every_observer_in_order() -> None:
    seen, later = Seen(), Seen()
    chain = Delivery([seen, later], batch_s=0.05)
    for i in range(3):
        chain.response_finished(_record(f"r{i}"))
    assert seen.ids == [] and later.ids == []
    await asyncio.sleep(0.1)
    assert seen.ids == later.ids == ["r0", "r1", "r2"]
    chain.response_finished(_record("r3"))  # a new batch, a new timer
    await asyncio.sleep(0.1)
    assert seen.ids == ["r0", "r1", "r2", "r3"]


async def test_flush_delivers_what_waits_at_once_and_only_once() -> None:
    seen = Seen()
    chain = Delivery([seen], batch_s=10.0)
    chain.response_finished(_record("a"))
    chain.response_finished(_record("b"))
    chain.flush()
    assert seen.ids == ["a", "b"]
    chain.flush()
    await asyncio.sleep(0)
    assert seen.ids == ["a", "b"]


async def test_a_full_batch_goes_before_its_time_in_slices_and_the_next_waits_again() -> None:
    seen = Seen()
    chain = Delivery([seen], batch_s=10.0)
    for i in range(FULL_BATCH - 1):
        chain.response_finished(_record(str(i)))
    await asyncio.sleep(0.05)
    assert seen.ids == []  # not full yet: it waits for its time
    chain.response_finished(_record("full"))
    assert seen.ids == []  # (not in the finishing exchange's turn: in the loop's next ones)
    deadline = asyncio.get_running_loop().time() + 5
    while len(seen.ids) < FULL_BATCH and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0)
    assert seen.ids == [*map(str, range(FULL_BATCH - 1)), "full"]
    chain.response_finished(_record("next"))  # a new batch: it waits for its time again
    await asyncio.sleep(0.05)
    assert seen.ids[-1] == "full"
    chain.flush()
    assert seen.ids[-1] == "next"


async def test_past_the_bound_the_oldest_record_goes_at_once() -> None:
    seen = Seen()
    chain = Delivery([seen], batch_s=10.0)
    for i in range(MAX_WAITING):
        chain.response_finished(_record(str(i)))
    assert seen.ids == []
    chain.response_finished(_record("one more"))
    chain.response_finished(_record("and another"))
    assert seen.ids == ["0", "1"] and len(chain._waiting) == MAX_WAITING
    chain.flush()
    assert seen.ids[-1] == "and another" and len(seen.ids) == MAX_WAITING + 2


async def test_a_batch_goes_in_slices_with_the_loops_other_work_between(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop is never held for a whole batch: past SLICE_S, the rest goes on the next turn."""
    monkeypatch.setattr(delivery_module, "SLICE_S", 0.0)  # one record per turn
    seen = Seen()
    chain = Delivery([seen], batch_s=0.01)
    for i in range(3):
        chain.response_finished(_record(str(i)))
    between: list[list[str]] = []  # what was delivered, seen from each turn of other work
    deadline = asyncio.get_running_loop().time() + 5
    while len(seen.ids) < 3 and asyncio.get_running_loop().time() < deadline:
        between.append(list(seen.ids))
        await asyncio.sleep(0)
    assert seen.ids == ["0", "1", "2"]
    assert ["0"] in between and ["0", "1"] in between and chain._timer is None


def test_outside_an_event_loop_a_record_is_delivered_at_once() -> None:
    seen = Seen()
    Delivery([seen], batch_s=10.0).response_finished(_record("alone"))
    assert seen.ids == ["alone"]


def test_without_a_batch_a_record_is_delivered_at_once() -> None:
    seen = Seen()
    Delivery([seen]).response_finished(_record("now"))
    assert seen.ids == ["now"]


async def test_the_record_is_final_before_it_waits() -> None:
    """The enrichers' facts are those of the moment it finished, and its text is writable, even
    when the batch goes later."""
    facts, seen = Facts(), Seen()
    chain = Delivery([seen], enrichers=[facts], batch_s=10.0)
    record = _record("r")
    record.model = "m\ud800"
    chain.response_finished(record)
    facts.now = 99.0
    chain.flush()
    assert record.upstream_running_max == 1.0
    assert record.model == "m?"


async def test_an_observer_that_fails_in_a_batch_stops_neither_the_others_nor_the_batch() -> None:
    seen = Seen()
    chain = Delivery([Failing(), seen], batch_s=10.0)
    records = [_record("a"), _record("b")]
    for record in records:
        chain.response_finished(record)
    chain.flush()
    assert seen.ids == ["a", "b"]
    assert all(record.observer_errors == ["Failing: RuntimeError: observer broke"] for record in records)


async def test_a_record_finished_by_an_observer_during_a_batch_goes_with_it() -> None:
    seen = Seen()

    class Chaining(Observer):
        def on_response(self, record: ResponseRecord) -> None:
            if record.request_id == "first":
                chain.response_finished(_record("second"))

    chain = Delivery([Chaining(), seen], batch_s=10.0)
    chain.response_finished(_record("first"))
    chain.flush()
    assert seen.ids == ["first", "second"]
    assert chain._timer is None and not chain._waiting


def test_the_bound_on_waiting_records_is_a_constant_of_the_module() -> None:
    assert delivery_module.MAX_WAITING == 256


async def test_a_finish_waits_with_the_batch_and_its_record_goes_in_the_same_flush() -> None:
    seen = Seen()
    chain = Delivery([seen], batch_s=10.0)
    ran: list[str] = []

    def finish() -> Iterator[None]:
        ran.append("finish")
        yield
        chain.response_finished(_record("late"))

    chain.response_finished(_record("first"))
    chain.later(finish())
    assert ran == [] and seen.ids == []
    chain.flush()
    assert ran == ["finish"] and seen.ids == ["first", "late"]
    assert chain._timer is None and not chain._waiting


def test_without_a_batch_a_finish_runs_at_once() -> None:
    seen = Seen()
    chain = Delivery([seen])

    def finish() -> Iterator[None]:
        yield
        chain.response_finished(_record("now"))

    chain.later(finish())
    assert seen.ids == ["now"]


async def test_a_finish_that_raises_loses_its_record_only_and_says_so() -> None:
    seen = Seen()
    chain = Delivery([seen], batch_s=10.0)

    def broken() -> Iterator[None]:
        yield
        raise ValueError("a diagnosis bug")

    chain.later(broken())
    chain.response_finished(_record("after"))
    with capture_logs() as logs:
        chain.flush()
    assert seen.ids == ["after"]
    assert [(line["event"], line["log_level"]) for line in logs] == [("record_failed", "error")]
    assert "a diagnosis bug" in logs[0]["error"]


async def test_a_finish_goes_a_step_per_turn_and_its_record_keeps_its_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step of a record's making is an item of its own (the loop's other work between two),
    and the records reach the observers in the order their exchanges ended, not the order their
    makings did."""
    monkeypatch.setattr(delivery_module, "SLICE_S", 0.0)  # one item per turn
    seen = Seen()
    chain = Delivery([seen], batch_s=0.001)
    steps: list[str] = []

    def finish(name: str, count: int) -> Iterator[None]:
        for i in range(count):
            steps.append(f"{name}{i}")
            yield
        chain.response_finished(_record(name))

    chain.later(finish("a", 3))
    chain.response_finished(_record("b"))
    chain.later(finish("c", 1))
    between: list[tuple[list[str], list[str]]] = []  # what each turn of other work saw
    deadline = asyncio.get_running_loop().time() + 5
    while len(seen.ids) < 3 and asyncio.get_running_loop().time() < deadline:
        between.append((list(steps), list(seen.ids)))
        await asyncio.sleep(0)
    assert seen.ids == ["a", "b", "c"] and steps == ["a0", "a1", "a2", "c0"]
    assert (["a0"], []) in between and (["a0", "a1"], []) in between and (["a0", "a1", "a2"], []) in between
    assert (["a0", "a1", "a2"], ["a"]) in between  # its record is an item too
    assert chain._timer is None and not chain._waiting


async def test_past_the_bound_waiting_finishes_go_one_for_one_without_recursion() -> None:
    """A full queue of finishes (overload): each new one delivers the oldest, whose record goes to
    the observers at once, not to the queue's end (no growth, no nesting)."""
    seen = Seen()
    chain = Delivery([seen], batch_s=10.0)

    def finish(i: int) -> Iterator[None]:
        yield
        yield
        chain.response_finished(_record(f"f{i}"))

    for i in range(MAX_WAITING * 8):
        chain.later(finish(i))
        assert len(chain._waiting) <= MAX_WAITING
    assert seen.ids == [f"f{i}" for i in range(MAX_WAITING * 7)]
    chain.flush()
    assert seen.ids == [f"f{i}" for i in range(MAX_WAITING * 8)]
