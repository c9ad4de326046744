"""Each simulated mechanism, seen through the real proxy: the record's stop reason is what the
proxy can tell from the wire alone, and the simulator's ground truth says it is right."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import openai
import pytest

from proxy.serve.app import RunningProxy, start_proxy
from proxy.simulator import RunningSimulator, SimulatorConfig, start_simulator
from proxy.simulator.settings import SCENARIOS
from tests.support.proxies import proxy_config

QUICK = {"token_time_s": 0.001, "prefill_time_per_token_s": 0.0}
MAX_TOKENS = 128
# About as long as the sweep's default prompt: the presets are sized for prompts like it.
PROMPT = "Explain in five short paragraphs how a bicycle's gears work"


class Setup:
    def __init__(self, sim: RunningSimulator, proxy: RunningProxy) -> None:
        self.sim = sim
        self.proxy = proxy

    async def chats(self, n: int, *, max_tokens: int | None = MAX_TOKENS, fault: str | None = None) -> None:
        """n concurrent streamed chats through the proxy, each read to its end (or its break)."""
        client = openai.AsyncOpenAI(base_url=f"{self.proxy.proxy_url}/v1", api_key="sk-test", max_retries=0)
        headers = {"X-Sim-Fault": fault} if fault else {}

        async def one(i: int) -> None:
            extra: dict[str, Any] = {"max_tokens": max_tokens} if max_tokens else {}
            try:
                stream = await client.chat.completions.create(
                    model="sim-7b", messages=[{"role": "user", "content": f"{PROMPT} ({i})"}],
                    stream=True, stream_options={"include_usage": True}, extra_headers=headers, **extra)
                async for _ in stream:
                    pass
            except openai.APIError:
                pass  # rejections and cut streams are what some tests are about

        await asyncio.gather(*(one(i) for i in range(n)))
        await client.close()

    async def records(self, n: int) -> list[dict[str, Any]]:
        """The proxy's records from its admin API, once n inference responses have ended."""
        async with aiohttp.ClientSession() as session:
            for _ in range(300):
                async with session.get(f"{self.proxy.admin_url}/api/requests?limit=1000") as resp:
                    found = [r for r in (await resp.json())["records"] if r["route"] != "other"]
                if len(found) >= n:
                    return found
                await asyncio.sleep(0.01)
        raise AssertionError(f"fewer than {n} records")


@pytest.fixture
async def setup(request: pytest.FixtureRequest) -> AsyncIterator[Setup]:
    config: SimulatorConfig = request.param
    sim = await start_simulator(config)
    proxy = await start_proxy(proxy_config(sim.url))
    yield Setup(sim, proxy)
    await proxy.close()
    await sim.close()


def configured(name: str, **changes: Any) -> SimulatorConfig:
    return replace(SCENARIOS[name], **{**QUICK, **changes})


@pytest.mark.parametrize("setup", [configured("clamp")], indirect=True)
async def test_clamp_is_a_length_stop_below_the_budget_a_server_limit(setup: Setup) -> None:
    await setup.chats(2)
    first = await setup.records(2)
    assert {r["stop_reason"] for r in first} == {"eos"}
    await setup.chats(4)
    records = (await setup.records(6))[:4]
    clamped = [r for r in records if r["stop_reason"] == "length"]
    assert clamped and all(r["length_cause"] == "server_limit" and r["output_tokens"] < MAX_TOKENS
                           and r["tokens_source"] == "usage" for r in clamped)
    assert setup.sim.engine.counters.finished_by_cause["length_kv_clamp"] == len(clamped)


@pytest.mark.parametrize("setup", [configured("slots")], indirect=True)
async def test_a_full_slot_context_is_a_length_stop_a_server_limit(setup: Setup) -> None:
    await setup.chats(6)
    records = await setup.records(6)
    cut = [r for r in records if r["stop_reason"] == "length"]
    assert cut and all(r["length_cause"] == "server_limit" for r in cut)
    assert setup.sim.engine.counters.finished_by_cause["length_slot_ctx"] == len(cut)


@pytest.mark.parametrize("setup", [configured("reject")], indirect=True)
async def test_a_refused_request_is_rejected(setup: Setup) -> None:
    await setup.chats(4)
    records = await setup.records(4)
    rejected = [r for r in records if r["stop_reason"] == "rejected"]
    assert rejected and all(r["status"] == 503 for r in rejected)
    assert len(rejected) == setup.sim.engine.counters.rejected
    assert {r["stop_reason"] for r in records} == {"rejected", "eos"}


@pytest.mark.parametrize("setup", [configured("deadline", deadline_s=0.05, token_time_s=0.005,
                                              natural_tokens=400)], indirect=True)
async def test_the_hidden_deadline_looks_like_eos_with_short_answers(setup: Setup) -> None:
    await setup.chats(2, max_tokens=None)
    records = await setup.records(2)
    assert {r["stop_reason"] for r in records} == {"eos"}  # all the wire shows
    assert all(r["output_tokens"] < 300 for r in records)  # natural ones are 300 to 500
    assert setup.sim.engine.counters.finished_by_cause == {"deadline": 2}


@pytest.mark.parametrize("setup", [configured("preempt")], indirect=True)
async def test_preempted_answers_still_end_eos(setup: Setup) -> None:
    await setup.chats(4)
    records = await setup.records(4)
    assert {r["stop_reason"] for r in records} == {"eos"}
    assert setup.sim.engine.counters.preemptions > 0


FAULTS = configured("healthy", natural_tokens=40, natural_spread=0.0)


@pytest.mark.parametrize(("setup", "fault", "stop_reason", "error_kind"), [
    (FAULTS, "cut_after=5", "upstream_disconnect", "reset"),
    (FAULTS, "error_after=3:CUDA out of memory", "upstream_error", "oom"),
    (FAULTS, "error_after=3:engine died", "upstream_error", "error_event"),
    (FAULTS, "status=503", "rejected", None),
    (FAULTS, "status=500", "upstream_error", "http_status"),
], indirect=["setup"])
async def test_fault_knobs_give_the_proxy_each_failure(setup: Setup, fault: str, stop_reason: str,
                                                      error_kind: str | None) -> None:
    await setup.chats(1, fault=fault)
    (record,) = await setup.records(1)
    assert record["stop_reason"] == stop_reason and record["upstream_error"] == error_kind


async def test_a_stall_longer_than_the_idle_timeout_is_an_idle_timeout() -> None:
    sim = await start_simulator(FAULTS)
    proxy = await start_proxy(proxy_config(sim.url, idle_timeout_s=0.2, deadline_mode="enforce"))
    setup = Setup(sim, proxy)
    try:
        await setup.chats(1, fault="stall_after=3:1.0")
        (record,) = await setup.records(1)
    finally:
        await proxy.close()
        await sim.close()
    assert record["stop_reason"] == "idle_timeout" and record["deadline_hit"] == "idle"
