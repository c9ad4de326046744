"""A prompt cut on the way in, against a real llama-server: its context shift drops the head of the
prompt and the answer still ends with EOS, looking complete; without a shift it refuses a prompt
longer than a slot instead. The proxy reads llama.cpp's own counts and the slot's context (`/props`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest

from proxy.config import HostPort, ProxyConfig
from proxy.serve.app import RunningProxy, start_proxy
from tests.real_servers.llamacpp.conftest import EOS_AFTER, EOS_PROMPT, EOS_PROMPT_TOKENS, SLOT_CTX, UNIFIED_PROMPT
from tests.real_servers.llamacpp.llama_server import ALIAS, LlamaServer
from tests.real_servers.llamacpp.test_proxy_against_llamacpp import GREEDY, new_id, record_of

pytestmark = pytest.mark.llamacpp


async def probing_proxy(upstream: str) -> RunningProxy:
    """A proxy that asks llama-server what it is and a slot's context (/props), once it knows."""
    running = await start_proxy(ProxyConfig(upstream=upstream, listen=HostPort("127.0.0.1", 0),
                                            admin_listen=HostPort("127.0.0.1", 0), gpu_poll_interval_s=0,
                                            upstream_metrics="auto", log_records=False))
    assert running.check is not None
    for _ in range(500):
        if running.check.identity.kind == "llamacpp":
            return running
        await asyncio.sleep(0.01)
    await running.close()
    raise AssertionError("the proxy never identified llama-server")


async def chat_stream(running: RunningProxy, prompt: str) -> tuple[str, str | None, str]:
    rid = new_id()
    text, finish = "", None
    async with openai.AsyncOpenAI(base_url=f"{running.proxy_url}/v1", api_key="unused", max_retries=0) as client:
        events = await client.chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": prompt}], max_tokens=400, stream=True,
            extra_headers={"X-Request-Id": rid}, **GREEDY)
        async for event in events:
            for choice in event.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
    return rid, finish, text


async def test_a_context_shift_that_drops_the_head_of_the_prompt_is_prompt_truncated(
        eos_shift_server: LlamaServer) -> None:
    """227 prompt tokens + 41 of answer need 268 of a 256-token slot: the slot shifts and the answer
    ends with EOS. The chat route says nothing of it; prompt + output past the slot shows it."""
    running = await probing_proxy(eos_shift_server.url)
    try:
        rid, finish, _ = await chat_stream(running, EOS_PROMPT)
        assert finish == "stop"  # it looks complete
        record = await record_of(running, rid)
        assert (record["stop_reason"], record["prompt_tokens"], record["output_tokens"]) == (
            "eos", EOS_PROMPT_TOKENS, EOS_AFTER + 1)
        assert (record["prompt_truncated"], record["context_tokens"]) == (True, SLOT_CTX)
        assert "shifted its context" in record["prompt_truncated_detail"]
    finally:
        await running.close()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_llamacpps_own_flag_shows_the_shift_on_its_native_route(eos_shift_server: LlamaServer,
                                                                     stream: bool) -> None:
    running = await probing_proxy(eos_shift_server.url)
    try:
        rid = new_id()
        # 231 characters and BOS: 232 tokens; the "\n" starts the model's 40-character answer, which
        # needs 273 tokens of a 256-token slot
        body = {"prompt": ("Tell me about llamas. " * 11)[:230] + "\n", "n_predict": 400, "stream": stream, **GREEDY}
        async with aiohttp.ClientSession() as session, session.post(
                f"{running.proxy_url}/completion", json=body, headers={"X-Request-Id": rid}) as resp:
            final: dict[str, Any] = {}
            if stream:
                async for line in resp.content:
                    if line.startswith(b"data: "):
                        final = json.loads(line[6:])
            else:
                final = await resp.json()
        assert final["truncated"] is True and final["stop"] is True
        record = await record_of(running, rid)
        assert record["truncated_flag"] is True and record["prompt_truncated"] is True
    finally:
        await running.close()


async def test_a_prompt_longer_than_a_slot_is_refused_not_cut(eos_split_server: LlamaServer) -> None:
    running = await probing_proxy(eos_split_server.url)
    try:
        rid = new_id()
        async with openai.AsyncOpenAI(base_url=f"{running.proxy_url}/v1", api_key="unused", max_retries=0) as client:
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(
                    model=ALIAS, messages=[{"role": "user", "content": UNIFIED_PROMPT}], max_tokens=10,
                    extra_headers={"X-Request-Id": rid}, **GREEDY)
        record = await record_of(running, rid)
        assert (record["stop_reason"], record["upstream_error"]) == ("upstream_error", "exceeds_context")
        assert record["prompt_truncated"] is False
    finally:
        await running.close()


async def test_a_prompt_and_answer_that_fit_the_slot_were_not_cut(eos_single_server: LlamaServer) -> None:
    running = await probing_proxy(eos_single_server.url)
    try:
        rid, finish, _ = await chat_stream(running, EOS_PROMPT)
        record = await record_of(running, rid)
        assert finish == "stop" and (record["prompt_truncated"], record["context_tokens"]) == (False, 512)
    finally:
        await running.close()
