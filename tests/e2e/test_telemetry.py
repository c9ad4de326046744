"""The proxy in front of the simulator with telemetry on: records carry the server's own state."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.record import ResponseRecord
from proxy.serve.app import RunningProxy, start_proxy
from proxy.simulator.server import RunningSimulator, start_simulator
from proxy.simulator.settings import SCENARIOS
from tests.support.proxies import proxy_config

INTERVAL = 0.05  # fast polls, so that even 0.2 s answers have samples inside them


@pytest.fixture
async def simulator() -> AsyncIterator[RunningSimulator]:
    sim = await start_simulator(replace(SCENARIOS["preempt"], seed=7))
    yield sim
    await sim.close()


async def proxied(simulator: RunningSimulator, mode: str) -> RunningProxy:
    config = proxy_config(simulator.url, upstream_metrics=mode, upstream_metrics_interval_s=INTERVAL,
                          gpu_poll_interval_s=INTERVAL)
    return await start_proxy(config)


async def until_upstream_seen(proxy: RunningProxy) -> None:
    for _ in range(200):
        if proxy.metrics.registry.get_sample_value("llm_proxy_upstream_telemetry_up", {"source": "vllm"}) == 1:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the proxy never read the simulator's /metrics")


async def records(proxy: RunningProxy, n: int) -> list[ResponseRecord]:
    for _ in range(300):
        found = [r for r in proxy.store.newest_first() if r.route != "other"]
        if len(found) >= n:
            return found
        await asyncio.sleep(0.01)
    raise AssertionError(f"fewer than {n} records")


async def run_chats(proxy: RunningProxy, n: int) -> None:
    client = openai.AsyncOpenAI(base_url=proxy.proxy_url + "/v1", api_key="sk-test", max_retries=0)

    async def one(i: int) -> None:
        stream = await client.chat.completions.create(
            model="sim-7b", messages=[{"role": "user", "content": f"tell me a story {i}"}],
            max_tokens=128, stream=True, extra_headers={"X-Request-Id": f"tele-{i}"})
        async for _ in stream:
            pass

    try:
        await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await client.close()


@pytest.mark.parametrize("mode", ["auto", "vllm"])
async def test_records_carry_the_simulators_running_kv_usage_and_preemptions(
        simulator: RunningSimulator, mode: str) -> None:
    proxy = await proxied(simulator, mode)
    try:
        await until_upstream_seen(proxy)
        await run_chats(proxy, 6)
        found = await records(proxy, 6)
        up_gpu = proxy.metrics.registry.get_sample_value("llm_proxy_gpu_telemetry_up")
    finally:
        await proxy.close()
    assert len(found) == 6
    for record in found:
        assert record.upstream_running_max is not None and record.upstream_running_max >= 1
        assert record.upstream_waiting_max is not None
        assert record.kv_cache_usage_max is not None and 0 < record.kv_cache_usage_max <= 1
        assert record.preemptions_during is not None and record.preemptions_during >= 0
        assert record.preemptions_scope == "server_wide"
    assert max(r.upstream_running_max or 0 for r in found) >= 2  # they ran side by side
    if up_gpu == 0:  # no NVIDIA driver here: no GPU fields, and nothing else disturbed
        assert all(r.gpu is None and r.vram_free_min_bytes is None for r in found)


async def test_the_simulators_state_is_reexported_on_the_admin_metrics(simulator: RunningSimulator) -> None:
    proxy = await proxied(simulator, "auto")
    try:
        await until_upstream_seen(proxy)
        async with aiohttp.ClientSession() as session, session.get(proxy.admin_url + "/metrics") as response:
            text = await response.text()
    finally:
        await proxy.close()
    names = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    assert {"llm_proxy_upstream_requests_running", "llm_proxy_upstream_requests_waiting",
            "llm_proxy_upstream_kv_cache_usage_ratio", "llm_proxy_upstream_preemptions_total",
            "llm_proxy_upstream_telemetry_up", "llm_proxy_gpu_telemetry_up"} <= names


async def test_telemetry_off_leaves_the_records_untagged(simulator: RunningSimulator) -> None:
    proxy = await start_proxy(proxy_config(simulator.url))  # the test default: telemetry off
    try:
        await run_chats(proxy, 1)
        (record,) = await records(proxy, 1)
    finally:
        await proxy.close()
    assert (record.upstream_running_max, record.kv_cache_usage_max, record.preemptions_during) == (None, None, None)
