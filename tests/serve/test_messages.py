"""The link between a worker and its supervisor, both ends in one process over a real socket pair:
a question gets its answer (or the failure, said, never raised on the answering side); what is told
in one turn of the loop goes in one write; a full link drops what is told but never an answer; a
closed link fails every question waiting; a frame past the bound closes the link."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from proxy.observers.record_store import RecordQuery
from proxy.serve import messages
from proxy.serve.messages import (
    FRAME,
    Link,
    LinkClosed,
    PageAsked,
    PageFound,
    RecordAsked,
    RecordFound,
    Settle,
    Settled,
    TelemetrySamples,
)


class Ends:
    def __init__(self, worker: Link, supervisor: Link, told: list[Any]) -> None:
        self.worker, self.supervisor, self.told = worker, supervisor, told


@pytest.fixture
async def ends() -> AsyncIterator[Ends]:
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    told: list[Any] = []

    async def answer(question: Any) -> Any:
        if isinstance(question, Settle):
            return Settled(True)
        if isinstance(question, PageAsked):
            return PageFound([(question.query.limit, b"{}")], False, 1, 10)
        if isinstance(question, RecordAsked):
            if question.request_id == "boom":
                raise ValueError("a bug in an answer")
            await asyncio.sleep(10)
        raise ValueError("unknown")

    worker = Link(told.append, answer)
    supervisor = Link(told.append)
    await loop.connect_accepted_socket(lambda: worker, a)
    await loop.connect_accepted_socket(lambda: supervisor, b)
    yield Ends(worker, supervisor, told)
    worker.close()
    supervisor.close()


async def test_a_question_gets_its_answer_and_several_go_at_once(ends: Ends) -> None:
    settled, page = await asyncio.gather(ends.supervisor.ask(Settle()),
                                         ends.supervisor.ask(PageAsked(RecordQuery(limit=7))))
    assert settled == Settled(True)
    assert page == PageFound([(7, b"{}")], False, 1, 10)


async def test_a_failed_answer_is_said_to_the_asker(ends: Ends) -> None:
    with pytest.raises(RuntimeError, match="ValueError: a bug in an answer"):
        await ends.supervisor.ask(RecordAsked("boom"))
    assert await ends.supervisor.ask(Settle()) == Settled(True)  # the link goes on


async def test_a_question_not_answered_in_time_times_out(ends: Ends) -> None:
    with pytest.raises(TimeoutError):
        await ends.supervisor.ask(RecordAsked("slow"), timeout_s=0.1)


async def test_what_is_told_in_one_turn_goes_in_one_write(ends: Ends, monkeypatch: pytest.MonkeyPatch) -> None:
    transport: Any = ends.worker._transport
    writes: list[bytes] = []
    real = transport.write
    monkeypatch.setattr(transport, "write", lambda data: (writes.append(bytes(data)), real(data))[1])
    for n in range(5):
        assert ends.worker.tell(TelemetrySamples(pids=frozenset({n})))
    await asyncio.sleep(0.05)
    assert len(writes) == 1
    assert [m.pids for m in ends.told] == [frozenset({n}) for n in range(5)]


async def test_a_full_link_drops_what_is_told_but_never_an_answer(ends: Ends,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(messages, "SEND_BUFFER_MAX", -1)
    assert not ends.worker.tell(TelemetrySamples())
    assert ends.worker.dropped == 1
    assert ends.worker.tell(TelemetrySamples(), always=True)
    assert await ends.supervisor.ask(Settle()) == Settled(True)  # (its answer went, past the bound)


async def test_a_closed_link_fails_the_questions_waiting_and_those_asked_after(ends: Ends) -> None:
    waiting = asyncio.ensure_future(ends.supervisor.ask(RecordAsked("slow")))
    await asyncio.sleep(0.05)
    ends.worker.close()
    with pytest.raises(LinkClosed):
        await waiting
    await asyncio.wait_for(ends.supervisor.closed.wait(), 1)
    with pytest.raises(LinkClosed):
        await ends.supervisor.ask(Settle())
    assert not ends.supervisor.tell(TelemetrySamples())


async def test_a_frame_past_the_bound_closes_the_link(ends: Ends) -> None:
    transport: Any = ends.supervisor._transport
    transport.write(FRAME.pack(messages.MAX_MESSAGE + 1) + b"x" * 10)
    await asyncio.wait_for(ends.worker.closed.wait(), 1)


async def test_a_message_that_cannot_be_read_is_skipped(ends: Ends) -> None:
    transport: Any = ends.supervisor._transport
    transport.write(FRAME.pack(3) + b"bad")
    assert await ends.supervisor.ask(Settle()) == Settled(True)
    assert not ends.worker.closed.is_set()


def test_every_message_is_a_dataclass_of_its_own() -> None:
    import dataclasses

    kinds = [value for name, value in vars(messages).items()
             if isinstance(value, type) and dataclasses.is_dataclass(value) and value.__module__ == messages.__name__]
    assert len(kinds) >= 12
    assert all(kind.__dataclass_params__.frozen for kind in kinds)  # type: ignore[attr-defined]
    assert RecordFound(None).record is None
