"""Models that left under a running answer. A llama.cpp router that swaps models (llama.cpp#22447, #24849: with
`--models-max 1` a request for another model kills the running one's answers). Its `/v1/models`
named the answer's model loaded when it began and not while it ran: the record says
`model_unloaded`, and the official `openai` client saw the break as the server made it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import openai
import pytest

from tests.support.llamacpp_router import FakeRouter
from tests.support.lmstudio_upstream import FakeLMStudio
from tests.support.proxies import ProxyFactory, record_for


@pytest.fixture
async def router() -> AsyncIterator[FakeRouter]:
    server = FakeRouter()
    await server.start()
    yield server
    await server.close()


async def ask(proxy_url: str, rid: str) -> None:
    client = openai.AsyncOpenAI(base_url=proxy_url + "/v1", api_key="k", max_retries=0,
                                default_headers={"X-Request-Id": rid})
    stream = await client.chat.completions.create(model="coder", messages=[{"role": "user", "content": "Go on."}],
                                                  stream=True)
    [chunk async for chunk in stream]


async def test_a_model_swapped_away_under_its_answer_is_named(router: FakeRouter, make_proxy: ProxyFactory) -> None:
    running = await make_proxy(router.url, upstream_metrics="auto", upstream_metrics_interval_s=0.05)
    ring = running.telemetry.upstream_ring
    for _ in range(200):
        if ring is not None and len(ring) and ring.latest()[1].loaded is not None:
            break
        await asyncio.sleep(0.01)
    await ask(running.proxy_url, "whole")  # the same model, left alone: whole
    router.swap_to = "writer"
    with pytest.raises(openai.APIError):
        await ask(running.proxy_url, "swapped")
    whole, swapped = await record_for(running, "whole"), await record_for(running, "swapped")
    assert (whole.stop_reason, whole.model_unloaded) == ("eos", None)
    assert (swapped.stop_reason, swapped.model_unloaded, swapped.cause, swapped.outcome) == (
        "upstream_disconnect", True, "model_unloaded", "cut")


@pytest.fixture
async def lmstudio() -> AsyncIterator[FakeLMStudio]:
    server = FakeLMStudio()
    await server.start()
    yield server
    await server.close()


async def test_a_model_lm_studio_evicted_under_its_answer_is_named(lmstudio: FakeLMStudio,
                                                                  make_proxy: ProxyFactory) -> None:
    """LM Studio's JIT auto-evict (lmstudio-bug-tracker#1796): its `/api/v0/models` said `loaded` when
    the answer began and `not-loaded` while it ran."""
    running = await make_proxy(lmstudio.url, upstream_metrics="auto", upstream_metrics_interval_s=0.05)
    ring = running.telemetry.upstream_ring
    for _ in range(200):
        if ring is not None and len(ring) and ring.latest()[1].loaded is not None:
            break
        await asyncio.sleep(0.01)
    assert ring is not None and ring.latest()[1].source == "lmstudio"
    lmstudio.evict_mid_answer = True
    client = openai.AsyncOpenAI(base_url=running.proxy_url + "/v1", api_key="k", max_retries=0,
                                default_headers={"X-Request-Id": "evicted"})
    with pytest.raises(openai.APIError):
        [c async for c in await client.chat.completions.create(
            model="qwen3-8b", messages=[{"role": "user", "content": "Go on."}], stream=True)]
    record = await record_for(running, "evicted")
    assert (record.stop_reason, record.model_unloaded, record.cause) == (
        "upstream_disconnect", True, "model_unloaded")
