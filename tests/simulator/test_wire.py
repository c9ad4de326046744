"""The simulator's wire formats, read by the official `openai` and `ollama` clients (and by raw
aiohttp where the exact bytes matter), against a real simulator on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

import aiohttp
import ollama
import openai
import orjson
import pytest

from proxy.simulator import RunningSimulator, SimulatorConfig, start_simulator

FAST = SimulatorConfig(token_time_s=0.001, natural_tokens=20, kv_blocks=0, kv_policy="none",
                       prefill_time_per_token_s=0.0)
MESSAGES = [{"role": "user", "content": "Why do answers end early?"}]


@pytest.fixture
async def sim() -> AsyncIterator[RunningSimulator]:
    simulator = await start_simulator(FAST)
    yield simulator
    await simulator.close()


@pytest.fixture
async def oai(sim: RunningSimulator) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="unused", max_retries=0)
    yield client
    await client.close()


@pytest.fixture
def oll(sim: RunningSimulator) -> ollama.AsyncClient:
    return ollama.AsyncClient(host=sim.url)


async def raw_post(url: str, body: object, headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body, headers=headers) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), await resp.read()


# --- OpenAI-compatible (vLLM) ------------------------------------------------------------------

async def test_openai_client_reads_a_streamed_chat_with_a_usage_chunk(oai: openai.AsyncOpenAI) -> None:
    stream = await oai.chat.completions.create(model="sim-7b", messages=MESSAGES, max_tokens=100,  # type: ignore[arg-type]
                                               stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "stop"
    assert finals[0].choices[0].model_extra == {"stop_reason": None}  # vLLM's extra field
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and usage_chunk.usage.completion_tokens == len([c for c in chunks if c.choices
                                                               and c.choices[0].delta.content]) + 1


async def test_openai_stream_without_include_usage_has_no_usage_chunk(oai: openai.AsyncOpenAI) -> None:
    stream = await oai.chat.completions.create(model="sim-7b", messages=MESSAGES, stream=True)  # type: ignore[arg-type]
    chunks = [chunk async for chunk in stream]
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


async def test_openai_client_reads_a_whole_chat_that_hit_its_budget(oai: openai.AsyncOpenAI) -> None:
    reply = await oai.chat.completions.create(model="sim-7b", messages=MESSAGES, max_completion_tokens=5)  # type: ignore[arg-type]
    assert reply.object == "chat.completion"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content


async def test_openai_client_reads_streamed_and_whole_completions(oai: openai.AsyncOpenAI) -> None:
    whole = await oai.completions.create(model="sim-7b", prompt="Once upon a time", max_tokens=7, seed=3)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 7
    stream = await oai.completions.create(model="sim-7b", prompt="Once upon a time", max_tokens=7, seed=3,
                                          stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7


async def test_a_stop_string_is_named_in_vllms_stop_reason(oai: openai.AsyncOpenAI) -> None:
    first = await oai.completions.create(model="sim-7b", prompt="stop here", max_tokens=10, seed=1)
    word = first.choices[0].text.split()[3]
    stopped = await oai.completions.create(model="sim-7b", prompt="stop here", max_tokens=10, seed=1, stop=[word])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["stop_reason"] == word  # type: ignore[index]
    assert word not in stopped.choices[0].text


async def test_the_same_seed_gives_the_same_answer_through_the_client(oai: openai.AsyncOpenAI) -> None:
    async def ask(seed: int) -> str:
        reply = await oai.chat.completions.create(model="sim-7b", messages=MESSAGES, seed=seed)  # type: ignore[arg-type]
        return reply.choices[0].message.content or ""

    assert await ask(11) == await ask(11)
    assert len({await ask(s) for s in range(4)}) > 1


async def test_openai_client_lists_the_served_model(oai: openai.AsyncOpenAI) -> None:
    models = [m async for m in oai.models.list()]
    assert [m.id for m in models] == ["sim-7b"] and models[0].owned_by == "vllm"


async def test_an_unknown_model_is_a_404_with_vllms_error_body(oai: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await oai.chat.completions.create(model="gpt-x", messages=MESSAGES)  # type: ignore[arg-type]
    assert caught.value.body == {"message": "The model `gpt-x` does not exist.", "type": "NotFoundError",
                                 "param": "model", "code": 404}


async def test_sse_bytes_are_data_lines_ending_with_done(sim: RunningSimulator) -> None:
    status, content_type, raw = await raw_post(f"{sim.url}/v1/chat/completions",
                                               {"messages": MESSAGES, "stream": True, "max_tokens": 3})
    assert status == 200 and content_type.startswith("text/event-stream")
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    last = orjson.loads(events[-3].removeprefix(b"data: "))
    assert last["choices"][0]["finish_reason"] == "length" and last["choices"][0]["delta"]["content"]
    assert all(e.startswith(b"data: ") for e in events[:-1])


async def test_bad_requests_get_a_json_400(sim: RunningSimulator) -> None:
    for body in ({"messages": []}, {"messages": MESSAGES, "max_tokens": 0}, {"messages": MESSAGES, "n": 2}):
        status, content_type, raw = await raw_post(f"{sim.url}/v1/chat/completions", body)
        assert status == 400 and content_type.startswith("application/json")
        assert orjson.loads(raw)["error"]["code"] == 400
    async with aiohttp.ClientSession() as session, \
            session.post(f"{sim.url}/v1/completions", data=b"{not json") as resp:
        assert resp.status == 400 and "invalid JSON" in (await resp.json())["error"]["message"]


# --- Ollama ------------------------------------------------------------------------------------

async def test_ollama_client_reads_a_streamed_chat(oll: ollama.AsyncClient) -> None:
    parts = [p async for p in await oll.chat(model="sim-7b", messages=MESSAGES, stream=True,
                                             options={"num_predict": 6})]
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    final = parts[-1]
    assert final.done_reason == "length" and final.eval_count == 6 and final.message.content == ""
    assert final.prompt_eval_count and final.total_duration and final.eval_duration
    assert final.load_duration is not None and final.prompt_eval_duration is not None
    assert final.total_duration >= final.eval_duration
    assert len([p for p in parts if p.message.content]) == 6


async def test_ollama_client_reads_a_whole_generate_that_ended_on_its_own(oll: ollama.AsyncClient) -> None:
    reply = await oll.generate(model="sim-7b:latest", prompt="Tell me a story", stream=False)
    assert reply.done and reply.done_reason == "stop" and reply.response
    assert reply.eval_count == len(reply.response.split()) + 1  # the words plus EOS


async def test_ollama_streams_by_default_as_ndjson(sim: RunningSimulator) -> None:
    status, content_type, raw = await raw_post(f"{sim.url}/api/generate",
                                               {"model": "sim-7b", "prompt": "hi", "options": {"num_predict": 3}})
    lines = [orjson.loads(line) for line in raw.splitlines()]
    assert status == 200 and content_type == "application/x-ndjson"
    assert [line["done"] for line in lines] == [False, False, False, True]
    assert set(lines[-1]) == {"model", "created_at", "response", "done_reason", "done", "total_duration",
                              "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
                              "eval_duration"}
    assert lines[0]["created_at"].endswith("Z") and "done_reason" not in lines[0]


async def test_ollama_num_ctx_limits_prompt_and_answer(oll: ollama.AsyncClient) -> None:
    reply = await oll.generate(model="sim-7b", prompt="x" * 40, options={"num_ctx": 16})
    assert reply.done_reason == "length" and reply.prompt_eval_count == 10 and reply.eval_count == 6


async def test_ollama_seed_option_reproduces_an_answer(oll: ollama.AsyncClient) -> None:
    async def ask(seed: int) -> str:
        return (await oll.chat(model="sim-7b", messages=MESSAGES, options={"seed": seed})).message.content or ""

    assert await ask(5) == await ask(5) != ""


async def test_an_empty_ollama_prompt_loads_the_model(oll: ollama.AsyncClient) -> None:
    reply = await oll.generate(model="sim-7b", prompt="")
    assert reply.done and reply.done_reason == "load" and reply.response == ""


async def test_ollama_unknown_model_is_a_404_error(oll: ollama.AsyncClient) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        await oll.chat(model="llama9", messages=MESSAGES)
    assert caught.value.status_code == 404 and "llama9" in caught.value.error


async def test_ollama_ps_tags_and_version(oll: ollama.AsyncClient, sim: RunningSimulator) -> None:
    ps = await oll.ps()
    assert [m.model for m in ps.models] == ["sim-7b:latest"]
    assert ps.models[0].size_vram == ps.models[0].size and ps.models[0].context_length == FAST.ctx_size
    listed = await oll.list()
    assert [m.model for m in listed.models] == ["sim-7b:latest"]
    async with aiohttp.ClientSession() as session, session.get(f"{sim.url}/api/version") as resp:
        assert "version" in await resp.json()


# --- both at once ------------------------------------------------------------------------------

async def test_both_dialects_share_one_engine(oai: openai.AsyncOpenAI, oll: ollama.AsyncClient,
                                              sim: RunningSimulator) -> None:
    await asyncio.gather(
        oai.chat.completions.create(model="sim-7b", messages=MESSAGES, max_tokens=4),  # type: ignore[arg-type]
        oll.chat(model="sim-7b", messages=MESSAGES, options={"num_predict": 4}))
    assert sim.engine.counters.finished_by_reason == {"length": 2}


async def test_a_client_that_goes_away_frees_its_sequence() -> None:
    sim = await start_simulator(replace(FAST, natural_tokens=100_000))
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{sim.url}/api/chat", json={"model": "sim-7b", "messages": MESSAGES,
                                                               "options": {"num_predict": 100000}})
        await resp.content.readline()
        resp.close()
    idle, aborted = await idle_then_closed(sim)
    assert idle and aborted == 1


async def idle_then_closed(sim: RunningSimulator) -> tuple[bool, int]:
    """Whether the engine went idle within 2 s, and how many sequences it aborted; then closed."""
    for _ in range(200):
        if sim.engine.idle:
            break
        await asyncio.sleep(0.01)
    idle, aborted = sim.engine.idle, sim.engine.counters.aborted
    await sim.close()
    return idle, aborted


async def test_a_client_that_leaves_a_whole_answer_frees_its_sequence() -> None:
    sim = await start_simulator(replace(FAST, natural_tokens=100_000))
    async with aiohttp.ClientSession() as session:
        with contextlib.suppress(TimeoutError):
            await session.post(f"{sim.url}/v1/completions", json={"prompt": "x"},
                               timeout=aiohttp.ClientTimeout(total=0.2))
    idle, aborted = await idle_then_closed(sim)
    assert idle and aborted == 1


async def test_stream_options_without_stream_is_a_400_as_in_vllm(sim: RunningSimulator) -> None:
    status, _, raw = await raw_post(f"{sim.url}/v1/chat/completions",
                                    {"messages": MESSAGES, "stream_options": {"include_usage": True}})
    assert status == 400 and orjson.loads(raw)["error"]["param"] == "stream_options"
