"""llama-cpp-python's own OpenAI server through the proxy: interrupted streams, and ids it refuses.

With its default `interrupt_requests`, the server ends a running stream with `data: [DONE]` and
no finish reason as soon as another request queues (llama_cpp/server/app.py): that is a load
effect, recorded as `interrupted`. It answers an X-Request-Id that is not a UUID with an empty 400
(starlette-context's RequestIdPlugin); the sweep sends UUIDs, and does without the header when
a server refuses it.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aiohttp
import pytest

from tests.real_servers.llamacpp.llama_cpp_python_server import LlamaCppPythonServer
from tests.real_servers.llamacpp.sweep_demo import sweep
from tests.real_servers.llamacpp.test_proxy_against_llamacpp import record_of

pytestmark = pytest.mark.llamacpp

BODY: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about llamas."}],
                        "max_tokens": 300, "stream": True, "temperature": 0}


async def test_a_stream_interrupted_for_a_queued_request_is_interrupted(python_server: LlamaCppPythonServer,
                                                                         proxy_for: Any) -> None:
    running = await proxy_for(python_server.url)
    first, second = str(uuid.uuid4()), str(uuid.uuid4())

    generating = asyncio.Event()

    async def stream(rid: str) -> bytes:
        if rid == second:  # queue it only once the first has produced text (a timer raced a slow prompt)
            await asyncio.wait_for(generating.wait(), 30)
        async with aiohttp.ClientSession() as session, session.post(
                f"{running.proxy_url}/v1/chat/completions", json=BODY, headers={"X-Request-Id": rid}) as resp:
            received = b""
            async for chunk in resp.content.iter_any():
                received += chunk
                if b'"content": "' in received.replace(b'"content": ""', b""):
                    generating.set()
            return received

    cut, _ = await asyncio.gather(stream(first), stream(second))
    assert cut.endswith(b"data: [DONE]\n\n") and b'"finish_reason": "length"' not in cut
    record = await record_of(running, first)
    assert (record["stop_reason"], record["finish_reason_raw"], record["status"]) == ("interrupted", None, 200)
    assert 0 < record["output_tokens"] < 300 and record["tokens_source"] == "counted"
    record = await record_of(running, second)
    assert (record["stop_reason"], record["length_cause"]) == ("length", "requested_budget")


async def test_an_id_that_is_not_a_uuid_gets_an_empty_400(python_server: LlamaCppPythonServer,
                                                           proxy_for: Any) -> None:
    running = await proxy_for(python_server.url)
    async with aiohttp.ClientSession() as session, session.post(
            f"{running.proxy_url}/v1/chat/completions", json={**BODY, "stream": False, "max_tokens": 4},
            headers={"X-Request-Id": "sweep-1234-c1-0000"}) as resp:
        assert (resp.status, await resp.read()) == (400, b"")
    record = await record_of(running, "sweep-1234-c1-0000")
    assert (record["stop_reason"], record["upstream_error"], record["upstream_error_detail"]) == (
        "upstream_error", "http_status", "HTTP 400")


async def test_the_sweep_runs_against_it_and_names_the_interruptions(python_eos_server: LlamaCppPythonServer) -> None:
    outcome, printed = await sweep(python_eos_server, "Tell me about llamas.", levels=(1, 2), repeats=3)
    assert [s.record.stop_reason for s in outcome.samples if s.level == 1] == ["eos"] * 3
    assert all(s.record_source == "proxy" for s in outcome.samples)
    verdict = outcome.verdict
    assert (verdict.kind, verdict.cause, verdict.onset_level) == ("serving_defect", "interrupted", 2), printed
    assert "the server interrupted running streams" in verdict.headline
