"""The proxy's admission gate (`--max-in-flight`), through the proxy with the official `openai` client:
fair across clients, bounded with a recorded 503, only for generations, settable behind the token."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from proxy.serve.app import RunningProxy
from tests.support.proxies import ProxyFactory, record_for
from tests.support.vllm_upstream import MODEL, FakeVllm

MESSAGES: Any = [{"role": "user", "content": "Say something."}]


@pytest.fixture
async def fake() -> AsyncIterator[FakeVllm]:
    server = FakeVllm(token_delay_s=0.01)
    await server.start()
    yield server
    await server.close()


async def ask(running: RunningProxy, rid: str, key: str = "k", max_tokens: int = 10) -> None:
    client = openai.AsyncOpenAI(base_url=running.proxy_url + "/v1", api_key=key, max_retries=0,
                                default_headers={"X-Request-Id": rid})
    [c async for c in await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                               max_tokens=max_tokens)]


async def scrape(running: RunningProxy) -> str:
    async with aiohttp.ClientSession() as session, session.get(running.admin_url + "/metrics") as response:
        return await response.text()


async def test_one_clients_twenty_queued_requests_hold_anothers_one_back_by_one_answer(
        fake: FakeVllm, make_proxy: ProxyFactory) -> None:
    running = await make_proxy(fake.url, max_in_flight=1)
    hog = [asyncio.create_task(ask(running, f"a-{n}", key="client-a")) for n in range(20)]
    for _ in range(200):
        if running.serving.forwarder.gate is not None and running.serving.forwarder.gate.waiting >= 19:
            break
        await asyncio.sleep(0.01)
    await ask(running, "b-0", key="client-b")
    b = await record_for(running, "b-0")
    await asyncio.gather(*hog)
    firsts = [await record_for(running, f"a-{n}") for n in range(3)]
    answer_s = max(r.duration_s - (r.queue_time_s or 0.0) for r in firsts)  # upstream time, its wait left out
    assert b.queue_time_source == "proxy" and b.queue_time_s is not None
    assert b.queue_time_s <= 2.5 * answer_s, (b.queue_time_s, answer_s)  # not twenty answers
    last_a = max([(await record_for(running, f"a-{n}")).queue_time_s or 0.0 for n in range(20)])
    assert last_a > 10 * answer_s
    assert b.concurrency_at_start == 1  # counted from its admission: alone upstream


async def test_past_its_bounds_the_gate_answers_503_with_retry_after_and_records_it(
        fake: FakeVllm, make_proxy: ProxyFactory) -> None:
    running = await make_proxy(fake.url, max_in_flight=1, queue_max=1, queue_timeout_s=0.3)
    first = asyncio.create_task(ask(running, "running", max_tokens=60))  # 0.6 s upstream
    await asyncio.sleep(0.1)
    second = asyncio.create_task(ask(running, "waits", max_tokens=5))
    gate = running.serving.forwarder.gate
    assert gate is not None
    for _ in range(100):
        if gate.waiting:
            break
        await asyncio.sleep(0.01)
    async with aiohttp.ClientSession() as session:
        async with session.post(running.proxy_url + "/v1/chat/completions", headers={"X-Request-Id": "full"},
                                json={"model": MODEL, "messages": MESSAGES, "stream": True}) as response:
            assert response.status == 503 and response.headers["Retry-After"].isdigit()
            assert (await response.json())["error"]["type"] == "admission_refused"
        async with session.get(running.proxy_url + "/v1/models") as response:
            assert response.status == 200  # not a generation: never held
    with pytest.raises(openai.APIStatusError) as timed_out:
        await second  # waited 0.3 s behind a 0.6 s answer
    assert timed_out.value.status_code == 503
    await first
    full, waited = await record_for(running, "full"), await record_for(running, "waits")
    assert (full.stop_reason, full.status, full.outcome) == ("rejected", 503, "cut")
    assert full.stop_detail is not None and "queue is full" in full.stop_detail
    assert waited.stop_reason == "rejected" and "--queue-timeout" in (waited.stop_detail or "")
    text = await scrape(running)
    assert re.search(r'^llm_proxy_admission_refused_total\{reason="queue_full"\} 1\.0$', text, re.MULTILINE)
    assert re.search(r'^llm_proxy_admission_refused_total\{reason="queue_timeout"\} 1\.0$', text, re.MULTILINE)


async def test_the_gate_is_set_at_run_time_behind_the_admin_token(fake: FakeVllm, make_proxy: ProxyFactory) -> None:
    running = await make_proxy(fake.url, admin_token="s3cret")
    url = running.admin_url + "/api/admission"
    async with aiohttp.ClientSession() as session:
        async with session.put(url, json={"max_in_flight": 2}) as response:
            assert response.status == 401
        auth = {"Authorization": "Bearer s3cret"}
        async with session.put(url, json={"max_in_flight": 0}, headers=auth) as response:
            assert response.status == 400
        async with session.put(url, json={"max_in_flight": 2, "queue_timeout_s": 5}, headers=auth) as response:
            assert response.status == 200
            assert (await response.json())["max_in_flight"] == 2
        await ask(running, "gated")
        assert (await record_for(running, "gated")).queue_time_source == "proxy"
        async with session.put(url, json={"max_in_flight": None}, headers=auth) as response:
            assert (await response.json())["max_in_flight"] is None
        async with session.get(url, headers=auth) as response:
            assert (await response.json())["waiting"] == 0
    await ask(running, "open")
    assert (await record_for(running, "open")).queue_time_source != "proxy"
    assert re.search(r"^llm_proxy_admission_limit 0\.0$", await scrape(running), re.MULTILINE)
