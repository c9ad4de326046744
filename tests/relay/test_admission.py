"""The admission gate alone: fair across clients, bounded, settable while it runs."""

from __future__ import annotations

import asyncio

import pytest

from proxy.relay.admission import AdmissionGate, GateSettings, Refused


async def test_an_open_gate_admits_at_once() -> None:
    gate = AdmissionGate()
    assert not gate.on and await gate.enter("a") == 0.0 and gate.in_flight == 1


async def test_a_place_goes_to_the_clients_in_turn() -> None:
    gate = AdmissionGate(GateSettings(max_in_flight=1))
    await gate.enter("a")  # running
    order: list[str] = []

    async def wait(client: str, n: int) -> None:
        await gate.enter(client)
        order.append(f"{client}{n}")

    tasks = [asyncio.create_task(wait("a", n)) for n in range(20)]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(wait("b", 0)))
    await asyncio.sleep(0)
    assert gate.waiting == 21
    for _ in range(21):
        gate.leave()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order.index("b0") <= 1, order  # B waited behind at most one of A's twenty
    assert [o for o in order if o.startswith("a")] == [f"a{n}" for n in range(20)]  # A's own order kept


async def test_a_full_queue_and_a_wait_past_the_timeout_are_refused() -> None:
    gate = AdmissionGate(GateSettings(max_in_flight=1, queue_max=1, queue_timeout_s=0.05))
    await gate.enter("a")
    waiting = asyncio.create_task(gate.enter("b"))
    await asyncio.sleep(0)
    with pytest.raises(Refused) as full:
        await gate.enter("c")
    assert full.value.reason == "queue_full"
    with pytest.raises(Refused) as late:
        await waiting
    assert late.value.reason == "queue_timeout" and gate.waiting == 0 and gate.in_flight == 1


async def test_a_client_that_leaves_the_queue_gives_up_its_turn() -> None:
    gate = AdmissionGate(GateSettings(max_in_flight=1))
    await gate.enter("a")
    gone = asyncio.create_task(gate.enter("b"))
    stays = asyncio.create_task(gate.enter("c"))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    gate.leave()
    await stays
    assert gate.in_flight == 1 and gate.waiting == 0


async def test_the_limit_changes_at_once() -> None:
    gate = AdmissionGate(GateSettings(max_in_flight=1))
    await gate.enter("a")
    waiters = [asyncio.create_task(gate.enter("b")) for _ in range(3)]
    await asyncio.sleep(0)
    gate.set(GateSettings(max_in_flight=3))
    await asyncio.sleep(0)
    assert gate.in_flight == 3 and gate.waiting == 1
    gate.set(GateSettings(max_in_flight=None))  # open: everyone in
    await asyncio.gather(*waiters)
    assert gate.in_flight == 4 and gate.waiting == 0
