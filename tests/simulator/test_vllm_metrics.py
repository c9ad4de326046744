"""The simulator's vLLM-style /metrics, read by prometheus_client's own parser."""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from proxy.simulator import SimulatorConfig, start_simulator

MESSAGES = [{"role": "user", "content": "Fill the cache."}]
VLLM_NAMES = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:gpu_cache_usage_perc", "vllm:num_preemptions", "vllm:prompt_tokens",
              "vllm:generation_tokens", "vllm:request_success", "vllm:cache_config_info"}


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Sample name (with its non-model labels) -> value."""
    async with session.get(f"{url}/metrics") as resp:
        assert resp.status == 200 and resp.content_type == "text/plain"
        text = await resp.text()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            extra = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                             if k not in ("model_name", "engine"))
            samples[f"{sample.name}{{{extra}}}" if extra else sample.name] = sample.value
    return samples


async def test_metrics_use_vllms_names_and_labels() -> None:
    sim = await start_simulator(SimulatorConfig())
    async with aiohttp.ClientSession() as session, session.get(f"{sim.url}/metrics") as resp:
        families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    await sim.close()
    assert set(families) >= VLLM_NAMES
    running = families["vllm:num_requests_running"].samples[0]
    assert running.labels == {"model_name": "sim-7b", "engine": "0"} and running.value == 0
    assert families["vllm:num_preemptions"].type == "counter"
    assert families["vllm:num_preemptions"].samples[0].name == "vllm:num_preemptions_total"


async def test_metrics_show_the_batch_the_cache_and_the_preemptions() -> None:
    config = SimulatorConfig(kv_blocks=6, kv_policy="preempt", token_time_s=0.002, natural_tokens=60,
                             natural_spread=0.0)
    sim = await start_simulator(config)
    async with aiohttp.ClientSession() as session:
        async def ask(i: int) -> None:
            body = {"messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 200}
            async with session.post(f"{sim.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200

        tasks = [asyncio.create_task(ask(i)) for i in range(3)]
        during = {}
        for _ in range(100):
            await asyncio.sleep(0.02)
            during = await scrape(session, sim.url)
            if during["vllm:num_requests_running"] >= 1 and during["vllm:kv_cache_usage_perc"] > 0.5:
                break
        await asyncio.gather(*tasks)
        after = await scrape(session, sim.url)
    await sim.close()
    assert during["vllm:num_requests_running"] >= 1
    assert 0.5 < during["vllm:kv_cache_usage_perc"] <= 1
    assert during["vllm:gpu_cache_usage_perc"] == during["vllm:kv_cache_usage_perc"]
    assert after["vllm:num_preemptions_total"] > 0
    assert after["vllm:request_success_total{finished_reason=stop}"] == 3
    assert after["llm_sim_finished_total{cause=eos}"] == 3
    assert after["vllm:num_requests_running"] == after["vllm:kv_cache_usage_perc"] == 0
    assert after["vllm:generation_tokens_total"] == 3 * 61


async def test_the_hidden_deadline_is_stop_on_the_wire_but_deadline_in_the_truth() -> None:
    config = SimulatorConfig(kv_blocks=0, kv_policy="none", deadline_s=0.05, token_time_s=0.005,
                             natural_tokens=200)
    sim = await start_simulator(config)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{sim.url}/v1/completions", json={"prompt": "long"}) as resp:
            body = await resp.json()
        samples = await scrape(session, sim.url)
    await sim.close()
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] < 200
    assert samples["vllm:request_success_total{finished_reason=stop}"] == 1
    assert samples["llm_sim_finished_total{cause=deadline}"] == 1
