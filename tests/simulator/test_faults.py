"""The X-Sim-Fault knobs: parsed exhaustively as pure logic, then seen by real clients."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import ollama
import openai
import orjson
import pytest

from proxy.simulator import RunningSimulator, SimulatorConfig, start_simulator
from proxy.simulator.faults import NO_FAULTS, FaultError, Faults, parse_faults

FAST = SimulatorConfig(token_time_s=0.001, natural_tokens=40, natural_spread=0.0, kv_blocks=0,
                       kv_policy="none", prefill_time_per_token_s=0.0)
MESSAGES = [{"role": "user", "content": "Tell me about faults."}]
CHAT = {"model": "sim-7b", "messages": MESSAGES, "stream": True}


# --- parsing -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("header", "expected"), [
    (None, NO_FAULTS),
    ("", NO_FAULTS),
    ("cut_after=5", Faults(cut_after=5)),
    ("stall_after=3:2.5", Faults(stall_after=3, stall_s=2.5)),
    ("error_after=4:CUDA out of memory", Faults(error_after=4, error_message="CUDA out of memory")),
    ("error_after=0:a:b", Faults(error_after=0, error_message="a:b")),
    ("status=503", Faults(status=503)),
    (" cut_after = 2 ; status=429 ", Faults(cut_after=2, status=429)),
])
def test_fault_headers_parse(header: str | None, expected: Faults) -> None:
    assert parse_faults(header) == expected


@pytest.mark.parametrize(("header", "message"), [
    ("cut_after", "expected NAME=VALUE"),
    ("cut_after=-1", "token count"),
    ("cut_after=x", "token count"),
    ("stall_after=3", "N:SECONDS"),
    ("stall_after=3:forever", "N:SECONDS"),
    ("stall_after=3:9999", "N:SECONDS"),
    ("error_after=3", "N:MESSAGE"),
    ("error_after=3:  ", "N:MESSAGE"),
    ("status=200", "400 to 599"),
    ("status=600", "400 to 599"),
    ("cut_after=1;cut_after=2", "given twice"),
    ("explode=1", "unknown"),
])
def test_malformed_fault_headers_say_what_is_wrong(header: str, message: str) -> None:
    with pytest.raises(FaultError, match=message):
        parse_faults(header)


# --- on the wire -------------------------------------------------------------------------------

@pytest.fixture
async def sim() -> AsyncIterator[RunningSimulator]:
    simulator = await start_simulator(FAST)
    yield simulator
    await simulator.close()


async def read_stream(url: str, body: object, fault: str) -> tuple[list[bytes], BaseException | None]:
    """The body's chunks as they came, and the error that ended the read, if any."""
    chunks: list[bytes] = []
    async with aiohttp.ClientSession() as session:
        try:
            async with session.post(url, json=body, headers={"X-Sim-Fault": fault}) as resp:
                async for chunk in resp.content.iter_any():
                    chunks.append(chunk)
        except aiohttp.ClientError as exc:
            return chunks, exc
    return chunks, None


async def test_cut_after_closes_the_sse_stream_with_no_final_event(sim: RunningSimulator) -> None:
    chunks, error = await read_stream(f"{sim.url}/v1/chat/completions", CHAT, "cut_after=5")
    assert isinstance(error, aiohttp.ClientPayloadError)
    raw = b"".join(chunks)
    assert b"[DONE]" not in raw and b'"finish_reason":"stop"' not in raw
    assert raw.count(b'"content":"') - 1 == 5  # the role chunk has content "" too


async def test_cut_after_breaks_the_openai_clients_stream(sim: RunningSimulator) -> None:
    client = openai.AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="unused", max_retries=0)
    seen = 0
    with pytest.raises(openai.APIError):
        stream = await client.chat.completions.create(model="sim-7b", messages=MESSAGES, stream=True,  # type: ignore[arg-type]
                                                      extra_headers={"X-Sim-Fault": "cut_after=3"})
        async for chunk in stream:
            seen += bool(chunk.choices and chunk.choices[0].delta.content)
    await client.close()
    assert seen == 3


async def test_cut_after_on_a_whole_response_disconnects_before_any_byte(sim: RunningSimulator) -> None:
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await session.post(f"{sim.url}/api/generate", json={"model": "sim-7b", "prompt": "x", "stream": False},
                               headers={"X-Sim-Fault": "cut_after=2"})
    for _ in range(100):
        if sim.engine.idle:
            break
        await asyncio.sleep(0.01)
    assert sim.engine.idle


async def test_cut_after_ends_ollama_ndjson_without_the_done_line(sim: RunningSimulator) -> None:
    chunks, error = await read_stream(f"{sim.url}/api/chat", {"model": "sim-7b", "messages": MESSAGES},
                                      "cut_after=4")
    lines = b"".join(chunks).splitlines()
    assert isinstance(error, aiohttp.ClientPayloadError)
    assert len(lines) == 4 and all(orjson.loads(line)["done"] is False for line in lines)


async def test_a_fault_past_the_answers_end_never_fires(sim: RunningSimulator) -> None:
    chunks, error = await read_stream(f"{sim.url}/v1/chat/completions", CHAT, "cut_after=1000")
    assert error is None and b"".join(chunks).endswith(b"data: [DONE]\n\n")


async def test_stall_after_pauses_the_stream_then_finishes_it(sim: RunningSimulator) -> None:
    gaps: list[float] = []
    async with aiohttp.ClientSession() as session, \
            session.post(f"{sim.url}/api/generate", json={"model": "sim-7b", "prompt": "stall"},
                         headers={"X-Sim-Fault": "stall_after=2:0.3"}) as resp:
        last = time.monotonic()
        lines = []
        while line := await resp.content.readline():
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            lines.append(orjson.loads(line))
    assert lines[-1]["done"] is True and lines[-1]["done_reason"] == "stop"
    assert gaps[2] >= 0.3  # a lower bound on a sleep, not a speed measurement


async def test_error_after_sends_vllms_error_event_then_done(sim: RunningSimulator) -> None:
    chunks, error = await read_stream(f"{sim.url}/v1/chat/completions", CHAT, "error_after=3:CUDA out of memory")
    events = b"".join(chunks).split(b"\n\n")
    assert error is None and events[-2] == b"data: [DONE]"
    assert orjson.loads(events[-3].removeprefix(b"data: ")) == {
        "error": {"message": "CUDA out of memory", "type": "InternalServerError", "param": None, "code": 500}}


async def test_error_after_raises_in_the_ollama_client(sim: RunningSimulator) -> None:
    fault = {"X-Sim-Fault": "error_after=2:llama runner process has terminated"}
    client = ollama.AsyncClient(host=sim.url, headers=fault)
    parts = []
    with pytest.raises(ollama.ResponseError, match="runner process has terminated"):
        async for part in await client.chat(model="sim-7b", messages=MESSAGES, stream=True):
            parts.append(part)
    assert len(parts) == 2


async def test_error_after_on_a_whole_response_is_a_500_json_error(sim: RunningSimulator) -> None:
    async with aiohttp.ClientSession() as session, \
            session.post(f"{sim.url}/v1/completions", json={"prompt": "x"},
                         headers={"X-Sim-Fault": "error_after=1:boom"}) as resp:
        assert resp.status == 500 and (await resp.json())["error"]["message"] == "boom"


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/api/chat", {"model": "sim-7b", "messages": MESSAGES}),
])
async def test_status_answers_at_once_with_a_json_error(sim: RunningSimulator, path: str, body: object) -> None:
    async with aiohttp.ClientSession() as session, \
            session.post(f"{sim.url}{path}", json=body, headers={"X-Sim-Fault": "status=503"}) as resp:
        assert resp.status == 503 and resp.content_type == "application/json"
        assert "error" in await resp.json()
    assert sim.engine.counters.generation_tokens == 0


async def test_a_malformed_fault_header_is_a_400_json_error(sim: RunningSimulator) -> None:
    async with aiohttp.ClientSession() as session, \
            session.post(f"{sim.url}/api/generate", json={"model": "sim-7b", "prompt": "x"},
                         headers={"X-Sim-Fault": "explode=1"}) as resp:
        assert resp.status == 400 and "unknown X-Sim-Fault" in (await resp.json())["error"]
