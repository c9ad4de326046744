"""The official `openai`, `anthropic` and `ollama` Python clients work unchanged through the proxy."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anthropic
import ollama
import openai
import pytest

from proxy.serve.app import RunningProxy
from proxy.simulator import RunningSimulator, SimulatorConfig, start_simulator
from tests.support.proxies import ProxyFactory, record_for
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.wire import JSON_HEADERS, NDJSON_HEADERS, ollama_stream, openai_completion, openai_stream


async def test_openai_client_streaming(upstream: ScriptedUpstream, proxy: RunningProxy) -> None:
    upstream.push(Script(openai_stream(4, "length"), delay=0.002))
    client = openai.AsyncOpenAI(base_url=proxy.proxy_url + "/v1", api_key="sk-test", max_retries=0)
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Request-Id": "oa-stream"})
    text, finish = "", None
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    await client.close()
    assert text == "t0 t1 t2 t3 " and finish == "length"
    record = await record_for(proxy, "oa-stream")
    assert record.stop_reason == "length" and record.length_cause == "requested_budget"
    assert upstream.seen[-1].headers["Authorization"] == "Bearer sk-test"


async def test_openai_client_non_streaming(upstream: ScriptedUpstream, proxy: RunningProxy) -> None:
    upstream.push(Script([openai_completion(3)], headers=JSON_HEADERS, content_length=True))
    client = openai.AsyncOpenAI(base_url=proxy.proxy_url + "/v1", api_key="sk-test", max_retries=0)
    completion = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    await client.close()
    assert completion.choices[0].finish_reason == "stop" and completion.usage is not None
    assert completion.usage.completion_tokens == 3


async def test_openai_client_sees_the_upstream_429(upstream: ScriptedUpstream, proxy: RunningProxy) -> None:
    body = b'{"error": {"message": "queue full", "type": "rate_limit_error", "code": 429}}'
    upstream.push(Script([body], status=429, headers=JSON_HEADERS, content_length=True))
    client = openai.AsyncOpenAI(base_url=proxy.proxy_url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        await client.chat.completions.create(model="m", messages=[])
    await client.close()


async def test_ollama_client_streaming_chat(upstream: ScriptedUpstream, proxy: RunningProxy) -> None:
    upstream.push(Script(ollama_stream(5, "length"), headers=NDJSON_HEADERS, delay=0.002))
    client = ollama.AsyncClient(host=proxy.proxy_url, headers={"X-Request-Id": "ol-stream"})
    parts = [part async for part in await client.chat(
        model="llama3.2", messages=[{"role": "user", "content": "hi"}], stream=True,
        options={"num_predict": 5})]
    assert "".join(p.message.content or "" for p in parts) == "t0 t1 t2 t3 t4 "
    assert parts[-1].done and parts[-1].done_reason == "length"
    record = await record_for(proxy, "ol-stream")
    assert record.stop_reason == "length" and record.length_cause == "requested_budget"


async def test_ollama_client_non_streaming_generate(upstream: ScriptedUpstream, proxy: RunningProxy) -> None:
    final = ollama_stream(0, chat=False)[-1]
    upstream.push(Script([final], headers=JSON_HEADERS, content_length=True))
    client = ollama.AsyncClient(host=proxy.proxy_url)
    result = await client.generate(model="llama3.2", prompt="hi", stream=False)
    assert result.done and result.eval_count == 0


# --- the new dialects, against the simulator speaking them --------------------------------------

SIM_MODEL = SimulatorConfig().model

@pytest.fixture
async def sim_proxy(make_proxy: ProxyFactory) -> AsyncIterator[tuple[RunningSimulator, RunningProxy]]:
    async with await start_simulator(SimulatorConfig(token_time_s=0.001)) as sim:
        yield sim, await make_proxy(sim.url)


async def test_anthropic_client_messages_create(sim_proxy: tuple[RunningSimulator, RunningProxy]) -> None:
    sim, proxy = sim_proxy
    client = anthropic.AsyncAnthropic(base_url=proxy.proxy_url, api_key="sk-ant-test", max_retries=0)
    message = await client.messages.create(model=SIM_MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                                           extra_headers={"X-Request-Id": "an-create"})
    await client.close()
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 8
    record = await record_for(proxy, "an-create")
    assert (record.dialect, record.route, record.stream) == ("anthropic", "/v1/messages", False)
    assert (record.stop_reason, record.length_cause, record.output_tokens, record.tokens_source) == (
        "length", "requested_budget", 8, "usage")
    assert record.ttft_s is None  # not a stream
    assert sim.engine.counters.finished_by_cause.get("length_requested") == 1


async def test_anthropic_client_messages_stream(sim_proxy: tuple[RunningSimulator, RunningProxy]) -> None:
    _, proxy = sim_proxy
    client = anthropic.AsyncAnthropic(base_url=proxy.proxy_url, api_key="sk-ant-test", max_retries=0)
    async with client.messages.stream(model=SIM_MODEL, max_tokens=2000, messages=[{"role": "user", "content": "hi"}],
                                      extra_headers={"X-Request-Id": "an-stream"}) as stream:
        text = "".join([piece async for piece in stream.text_stream])
        final = await stream.get_final_message()
    await client.close()
    assert final.stop_reason == "end_turn" and text
    record = await record_for(proxy, "an-stream")
    assert (record.stop_reason, record.output_tokens, record.tokens_source, record.stream) == (
        "eos", final.usage.output_tokens, "usage", True)
    assert record.ttft_s is not None and record.prompt_tokens == final.usage.input_tokens


@pytest.mark.parametrize("stream", [True, False])
async def test_openai_client_responses_create(sim_proxy: tuple[RunningSimulator, RunningProxy], stream: bool) -> None:
    _, proxy = sim_proxy
    client = openai.AsyncOpenAI(base_url=proxy.proxy_url + "/v1", api_key="sk-test", max_retries=0)
    rid = f"resp-{stream}"
    if stream:
        events = await client.responses.create(model=SIM_MODEL, input="hi", max_output_tokens=6, stream=True,
                                               extra_headers={"X-Request-Id": rid})
        final = None
        async for event in events:
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
        assert final is not None
    else:
        final = await client.responses.create(model=SIM_MODEL, input="hi", max_output_tokens=6,
                                              extra_headers={"X-Request-Id": rid})
    await client.close()
    assert final.status == "incomplete" and final.incomplete_details is not None
    assert final.incomplete_details.reason == "max_output_tokens"
    record = await record_for(proxy, rid)
    assert (record.dialect, record.stop_reason, record.length_cause, record.output_tokens) == (
        "responses", "length", "requested_budget", 6)
    assert (record.ttft_s is not None) == stream
