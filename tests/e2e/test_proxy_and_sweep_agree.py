"""The proxy and the sweep build a record of the same stream with the same code: they agree.

The sweep reads each response on the client's side with the proxy's own Recorder; here one
stream goes through the proxy while the sweep reads it, and the two records must classify alike.
"""

from __future__ import annotations

import aiohttp
import pytest

from proxy.serve.app import RunningProxy
from proxy.sweep.runner import SweepPlan, request_body, send_one
from tests.support.proxies import record_for
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.wire import (
    NDJSON_HEADERS,
    SSE_HEADERS,
    anthropic_stream,
    chat_chunk,
    ollama_stream,
    openai_stream,
    responses_stream,
    sse,
)

COMPARED = ("dialect", "route", "model", "stream", "status", "requested_max_tokens", "output_tokens", "tokens_source",
            "prompt_tokens", "reasoning_tokens", "visible_tokens", "reasoning_share", "stop_reason",
            "stop_reason_certain", "finish_reason_raw", "length_cause", "upstream_error", "seed", "temperature")


def reasoning_chunks(thinking: int, answer: int) -> list[bytes]:
    chunks = [sse(chat_chunk("", role=True))]
    for i in range(thinking):
        chunk = chat_chunk()
        chunk["choices"][0]["delta"] = {"reasoning": f"r{i}"}
        chunks.append(sse(chunk))
    return chunks + [sse(chat_chunk(f"a{i}")) for i in range(answer)] + [sse(chat_chunk(None, "length")),
                                                                         b"data: [DONE]\n\n"]


CASES = [
    ("openai", openai_stream(16, "length"), SSE_HEADERS),
    ("openai", openai_stream(9, "length", usage=False), SSE_HEADERS),
    ("openai", reasoning_chunks(12, 4), SSE_HEADERS),
    ("openai", openai_stream(3, stop_reason="###"), SSE_HEADERS),
    ("ollama", ollama_stream(16, "length"), NDJSON_HEADERS),
    ("anthropic", anthropic_stream(4, "max_tokens", thinking=12), SSE_HEADERS),
    ("anthropic", anthropic_stream(5, "end_turn", usage=False), SSE_HEADERS),
    ("responses", responses_stream(16, "incomplete", reason="max_output_tokens"), SSE_HEADERS),
    ("responses", responses_stream(16), SSE_HEADERS),
]


@pytest.mark.parametrize(("dialect", "chunks", "headers"), CASES)
async def test_one_stream_read_by_the_proxy_and_by_the_sweep_gives_one_diagnosis(
        upstream: ScriptedUpstream, proxy: RunningProxy, dialect: str, chunks: list[bytes],
        headers: dict[str, str]) -> None:
    plan = SweepPlan(target=proxy.proxy_url, levels=(1,), repeats=1, prompt="hi", max_tokens=16, seed=7, model="m",
                     dialect=dialect)  # type: ignore[arg-type]
    upstream.push(Script(chunks, headers=headers, delay=0.001))
    async with aiohttp.ClientSession() as session:
        sample = await send_one(session, plan, request_body(plan), f"agree-{dialect}", 1, 0, 1)
    ours = await record_for(proxy, f"agree-{dialect}")
    theirs = sample.record
    assert {f: getattr(theirs, f) for f in COMPARED} == {f: getattr(ours, f) for f in COMPARED}
    assert theirs.bytes_out == ours.bytes_out == sum(len(c) for c in chunks)
