"""What Ollama does to prompts and answers that the wire alone hides, through the proxy, with the
official `ollama` and `openai` clients against a fake built from Ollama's source
(tests/support/ollama_upstream.py): a conversation cut silently to fit the context, a chat with no
user turn answered with nothing, and thinking that spends the whole num_predict."""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.serve.app import RunningProxy
from proxy.sweep.runner import SweepPlan, run_sweep
from proxy.sweep.stats import by_level, summarize
from proxy.sweep.verdict import decide
from tests.support.ollama_upstream import MODEL, FakeOllama
from tests.support.proxies import ProxyFactory, record_for

ROOT = Path(__file__).resolve().parents[2]
LONG_CHAT = [{"role": "system", "content": "You are the tool-using agent. Tools: search, read, write."},
             *[{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "lorem ipsum dolor " * 30}
               for i in range(12)]]


@pytest.fixture
async def fake() -> AsyncIterator[FakeOllama]:
    server = FakeOllama()
    await server.start()
    yield server
    await server.close()


async def ollama_proxy(make_proxy: ProxyFactory, fake: FakeOllama) -> RunningProxy:
    """A proxy that asks the upstream what it is (the probe `--upstream-metrics` allows), once it knows."""
    running = await make_proxy(fake.url, upstream_metrics="ollama", upstream_metrics_interval_s=0.2)
    assert running.check is not None
    for _ in range(200):
        if running.check.identity.kind == "ollama":
            return running
        await asyncio.sleep(0.01)
    raise AssertionError("the proxy never identified the fake as Ollama")


async def metric(running: RunningProxy, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(running.admin_url + "/metrics") as response:
        text = await response.text()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


# --- a conversation cut to fit --------------------------------------------------------------------

async def test_a_conversation_cut_silently_to_fit_num_ctx_is_prompt_truncated(
        fake: FakeOllama, make_proxy: ProxyFactory) -> None:
    running = await ollama_proxy(make_proxy, fake)
    client = ollama.AsyncClient(host=running.proxy_url, headers={"X-Request-Id": "cut"})
    parts = [part async for part in await client.chat(model=MODEL, messages=LONG_CHAT, stream=True,
                                                      options={"num_ctx": 256})]
    assert parts[-1].done_reason == "stop"  # the answer looks complete
    record = await record_for(running, "cut")
    assert (record.stop_reason, record.outcome, record.prompt_truncated) == ("eos", "complete", True)
    assert record.prompt_tokens == fake.prompts[-1] and record.prompt_tokens <= 256
    assert record.context_tokens == 256
    assert record.prompt_truncated_detail is not None and "cut the prompt" in record.prompt_truncated_detail
    assert await metric(running, "llm_proxy_prompt_truncated_total", model=MODEL) == 1


async def test_a_conversation_that_fits_is_not_called_cut(fake: FakeOllama, make_proxy: ProxyFactory) -> None:
    """Its bytes, with the template and system prompt /api/show gives, bound its tokens from above,
    within num_ctx: nothing was cut."""
    running = await ollama_proxy(make_proxy, fake)
    await until_shown(running)
    client = ollama.AsyncClient(host=running.proxy_url, headers={"X-Request-Id": "whole"})
    await client.chat(model=MODEL, messages=LONG_CHAT[:3], options={"num_ctx": 4096})
    record = await record_for(running, "whole")
    assert record.prompt_truncated is False and record.stop_reason == "eos"
    assert record.prompt_truncated_detail is not None and "at most" in record.prompt_truncated_detail
    assert record.context_tokens == 4096
    assert await metric(running, "llm_proxy_prompt_truncated_total") == 0


async def test_a_one_line_question_is_not_cut(fake: FakeOllama, make_proxy: ProxyFactory) -> None:
    """A question of 41 bytes cannot fill a 2,048-token context, whatever its tokenizer: false, not unknown."""
    fake.context = 2048
    running = await ollama_proxy(make_proxy, fake)
    await until_shown(running)
    client = ollama.AsyncClient(host=running.proxy_url, headers={"X-Request-Id": "short"})
    await client.chat(model=MODEL, messages=[{"role": "user", "content": "What is the capital city of Australia?"}])
    record = await record_for(running, "short")
    assert record.prompt_truncated is False and record.context_tokens == 2048


async def test_a_conversation_past_the_context_on_the_openai_route_is_cut(
        fake: FakeOllama, make_proxy: ProxyFactory) -> None:
    """On /v1/chat/completions Ollama ignores options.num_ctx and the loaded context applies: a
    conversation whose words alone pass it was cut, whatever count came back."""
    fake.context = 2048
    running = await ollama_proxy(make_proxy, fake)
    client = openai.AsyncOpenAI(base_url=running.proxy_url + "/v1", api_key="x", max_retries=0,
                                default_headers={"X-Request-Id": "long-v1"})
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa " * 33
    chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": words} for i in range(10)]
    await client.chat.completions.create(model=MODEL, messages=chat)  # type: ignore[arg-type]
    record = await record_for(running, "long-v1")
    assert record.prompt_truncated is True and record.context_tokens == 2048
    assert record.prompt_truncated_detail is not None and "3,300 words" in record.prompt_truncated_detail


async def test_between_the_bounds_it_stays_open_with_both_said(fake: FakeOllama, make_proxy: ProxyFactory) -> None:
    """A model with a built-in renderer shows no template: no upper bound, and a count above the
    words proves nothing: null, with what is known."""
    fake.template = None
    running = await ollama_proxy(make_proxy, fake)
    client = ollama.AsyncClient(host=running.proxy_url, headers={"X-Request-Id": "open"})
    await client.chat(model=MODEL, messages=LONG_CHAT[:3], options={"num_ctx": 4096})
    record = await record_for(running, "open")
    detail = record.prompt_truncated_detail or ""
    assert record.prompt_truncated is None
    assert "at least" in detail and "no upper bound" in detail and "no tokenizer" in detail


async def until_shown(running: RunningProxy) -> None:
    """The proxy knows the model's template (its /api/show), asked once the model is loaded."""
    for _ in range(300):
        info = running.check.identity.info_for(MODEL)
        if info is not None and info.template_bytes is not None:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the proxy never read the model's template")


async def test_the_ollama_route_alone_is_enough_to_read_its_count(fake: FakeOllama, make_proxy: ProxyFactory) -> None:
    """With --upstream-metrics off the proxy asks the server nothing; Ollama's own route still says
    whose count it is."""
    running = await make_proxy(fake.url)
    client = ollama.AsyncClient(host=running.proxy_url, headers={"X-Request-Id": "quiet"})
    await client.chat(model=MODEL, messages=LONG_CHAT, options={"num_ctx": 256})
    record = await record_for(running, "quiet")
    assert record.prompt_truncated is True and record.context_tokens == 256


async def test_ollamas_v1_count_after_the_cut_proves_it_too(fake: FakeOllama, make_proxy: ProxyFactory) -> None:
    fake.context = 200  # no num_ctx on /v1: the context Ollama gives the model (/api/ps)
    running = await ollama_proxy(make_proxy, fake)
    client = openai.AsyncOpenAI(base_url=running.proxy_url + "/v1", api_key="ollama", max_retries=0)
    stream = await client.chat.completions.create(model=MODEL, messages=LONG_CHAT, stream=True,  # type: ignore[arg-type]
                                                  stream_options={"include_usage": True},
                                                  extra_headers={"X-Request-Id": "v1cut"})
    async for _ in stream:
        pass
    await client.close()
    record = await record_for(running, "v1cut")
    assert (record.dialect, record.prompt_truncated, record.context_tokens) == ("openai", True, 200)


async def test_a_context_split_between_parallel_requests_is_named_by_the_sweep_with_its_onset(
        fake: FakeOllama, make_proxy: ProxyFactory) -> None:
    """Each request gets context / in flight: a 300-word prompt fits alone in 512 tokens and is cut
    from concurrency 2 on (the runner keeps num_keep tokens and the tail)."""
    fake.context, fake.split, fake.answer, fake.token_delay_s = 512, True, 20, 0.004
    running = await ollama_proxy(make_proxy, fake)
    plan = SweepPlan(target=running.proxy_url, levels=(1, 2, 4), repeats=2, prompt="word " * 300, max_tokens=64,
                     seed=1, model=MODEL, dialect="ollama", admin=running.admin_url, warmup=0, timeout_s=30.0)
    samples = (await run_sweep(plan)).samples
    assert all(s.record_source == "proxy" for s in samples)
    cut = {s.level: s.record.prompt_truncated for s in samples}
    assert cut[1] is None and cut[4] is True
    verdict = decide(summarize(samples), by_level(samples))
    assert (verdict.kind, verdict.cause, verdict.onset_level) == ("serving_defect", "prompt_truncated", 2)
    assert verdict.headline.startswith("prompts are cut on the way in from concurrency 2")
    assert any("OLLAMA_NUM_PARALLEL" in line for line in verdict.evidence)
    assert "num_ctx" in verdict.recommendation


# --- nothing generated ------------------------------------------------------------------------------

async def test_a_chat_without_a_user_turn_answered_load_is_not_generated(
        fake: FakeOllama, make_proxy: ProxyFactory) -> None:
    running = await make_proxy(fake.url)
    client = ollama.AsyncClient(host=running.proxy_url, headers={"X-Request-Id": "sys-only"})
    answer = await client.chat(model=MODEL, messages=[{"role": "system", "content": "Be brief."}])
    assert answer.done_reason == "load" and answer.message.content == ""
    record = await record_for(running, "sys-only")
    assert (record.stop_reason, record.cause, record.outcome) == ("not_generated", "no_user_turn", "client_error")
    assert record.stop_detail is not None and "no user turn" in record.stop_detail
    assert record.truncated and record.user_turn is False
    assert await metric(running, "llm_proxy_requests_total", cause="no_user_turn", outcome="client_error") == 1


async def test_a_model_load_with_no_messages_stays_not_inference(fake: FakeOllama, make_proxy: ProxyFactory) -> None:
    running = await make_proxy(fake.url)
    client = ollama.AsyncClient(host=running.proxy_url, headers={"X-Request-Id": "load"})
    answer = await client.chat(model=MODEL, messages=[])
    assert answer.done_reason == "load"
    record = await record_for(running, "load")
    assert (record.stop_reason, record.outcome) == ("not_inference", "not_inference")


# --- thinking that spends the budget ---------------------------------------------------------------

@pytest.mark.parametrize("stream", [True, False])
async def test_thinking_that_spends_num_predict_is_mostly_reasoning_native(
        fake: FakeOllama, make_proxy: ProxyFactory, stream: bool) -> None:
    fake.thinking = 40
    running = await make_proxy(fake.url)
    client = ollama.AsyncClient(host=running.proxy_url, headers={"X-Request-Id": f"think-{stream}"})
    messages = [{"role": "user", "content": "why is the sky blue?"}]
    if stream:
        parts = [p async for p in await client.chat(model=MODEL, messages=messages, stream=True,
                                                    options={"num_predict": 16})]
        assert "".join(p.message.content or "" for p in parts) == ""
    else:
        answer = await client.chat(model=MODEL, messages=messages, options={"num_predict": 16})
        assert answer.message.content == "" and answer.message.thinking and answer.done_reason == "length"
    record = await record_for(running, f"think-{stream}")
    assert (record.stop_reason, record.length_cause, record.output_tokens) == ("length", "requested_budget", 16)
    assert (record.reasoning_tokens, record.visible_tokens, record.reasoning_share) == (16, 0, 1.0)
    assert record.budget_mostly_reasoning
    assert await metric(running, "llm_proxy_requests_total", reasoning="mostly") == 1


@pytest.mark.parametrize("stream", [True, False])
async def test_thinking_that_spends_max_tokens_is_mostly_reasoning_on_ollamas_v1(
        fake: FakeOllama, make_proxy: ProxyFactory, stream: bool) -> None:
    fake.thinking = 40
    running = await make_proxy(fake.url)
    client = openai.AsyncOpenAI(base_url=running.proxy_url + "/v1", api_key="ollama", max_retries=0)
    messages = [{"role": "user", "content": "why is the sky blue?"}]
    rid = f"v1think-{stream}"
    if stream:
        events = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,  # type: ignore[arg-type]
                                                      stream=True, extra_headers={"X-Request-Id": rid})
        async for _ in events:
            pass
    else:
        answer = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,  # type: ignore[arg-type]
                                                      extra_headers={"X-Request-Id": rid})
        assert answer.choices[0].message.content == "" and answer.choices[0].finish_reason == "length"
    await client.close()
    record = await record_for(running, rid)
    assert (record.stop_reason, record.reasoning_tokens, record.visible_tokens) == ("length", record.output_tokens, 0)
    assert record.budget_mostly_reasoning


async def test_diagnose_names_prompts_cut_under_load_from_live_records(
        fake: FakeOllama, make_proxy: ProxyFactory, tmp_path: Path) -> None:
    """Live traffic, not a sweep: one request at a time, then bursts of four; the history's records alone
    say that prompts are cut from concurrency 4, and the command says which sweep would settle it."""
    fake.context, fake.split, fake.answer, fake.token_delay_s = 512, True, 30, 0.004
    history = tmp_path / "history.sqlite3"
    running = await make_proxy(fake.url, history_path=str(history))
    client = ollama.AsyncClient(host=running.proxy_url)
    messages = [{"role": "user", "content": "word " * 300}]
    for _ in range(6):
        await client.chat(model=MODEL, messages=messages, options={"num_predict": 64})
    for _ in range(3):
        await asyncio.gather(*(client.chat(model=MODEL, messages=messages, options={"num_predict": 64})
                               for _ in range(4)))
    assert running.history is not None
    while running.history.written < 18:
        await asyncio.sleep(0.05)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "diagnose", "--history", str(history), "--min-per-level", "3",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT)
    out, err = await process.communicate()
    text = out.decode()
    assert process.returncode == 0, err.decode()
    assert "VERDICT (serving_defect): prompts are cut on the way in from concurrency 4" in text, text
    assert re.search(r"prompt_truncated \d+", text) and "llm-diag-proxy sweep" in text


async def test_a_model_unloaded_under_its_answer_is_named(fake: FakeOllama, make_proxy: ProxyFactory) -> None:
    """/api/ps listed the model when the answer began and not while it ran (ollama#8398: a cancelled
    load cancels the requests waiting on it), and the stream broke: the cause is model_unloaded."""
    fake.unload_mid_answer = True
    fake.answer = 20
    fake.token_delay_s = 0.05
    running = await make_proxy(fake.url, upstream_metrics="ollama", upstream_metrics_interval_s=0.05)
    for _ in range(200):
        if running.telemetry.upstream_ring is not None and len(running.telemetry.upstream_ring):
            break
        await asyncio.sleep(0.01)
    client = ollama.AsyncClient(host=running.proxy_url, headers={"X-Request-Id": "unloaded"})
    with pytest.raises(Exception):  # noqa: B017 (the client sees the break as the server made it)
        [part async for part in await client.chat(model=MODEL, messages=LONG_CHAT[:2], stream=True)]
    record = await record_for(running, "unloaded")
    assert (record.stop_reason, record.model_unloaded, record.cause, record.outcome) == (
        "upstream_disconnect", True, "model_unloaded", "cut")
