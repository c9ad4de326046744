"""The real vLLM's own request spans, sent to the proxy's receiver and joined to its records.

vLLM starts with `--otlp-traces-endpoint http://PROXY_ADMIN/v1/traces` (protocol http/protobuf, its
batch exporter every 100 ms), so the proxy listens first, on a port chosen before vLLM starts; one
test runs every case on the one server (a start costs 40-60 s)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import openai
import pytest

from proxy.config import HostPort
from proxy.record import ResponseRecord
from tests.real_servers.vllm.test_proxy_against_vllm import GREEDY, LONG_PROMPT
from tests.real_servers.vllm.vllm_server import MAX_NUM_SEQS, SERVED_NAME, VllmServer
from tests.support.ports import free_port

pytestmark = pytest.mark.vllm


class TracedVllm(VllmServer):
    def environment(self) -> dict[str, str]:
        return {**super().environment(), "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                "OTEL_BSP_SCHEDULE_DELAY": "100"}


async def joined(running: Any, rid: str, timeout_s: float = 30.0) -> ResponseRecord:
    for _ in range(int(timeout_s / 0.05)):
        record = running.store.get(rid)
        if record is not None and record.server_trace is not None:
            return record  # type: ignore[no-any-return]
        await asyncio.sleep(0.05)
    raise AssertionError(f"no record of {rid} past the span's wait: {running.store.get(rid)}")


async def stream(client: openai.AsyncOpenAI, rid: str, max_tokens: int | None, prompt: str = "hello",
                 leave_after: int | None = None) -> None:
    events = await client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, stream=True,
        extra_headers={"X-Request-Id": rid}, **GREEDY)
    seen = 0
    async for event in events:
        seen += sum(1 for c in event.choices if c.delta.content)
        if leave_after is not None and seen >= leave_after:
            await events.close()
            return


@pytest.mark.timeout(400)
async def test_vllms_spans_decide_what_the_wire_leaves_open(tmp_path: Path, vllm_model: Path,
                                                             proxy_for: Any) -> None:
    admin = free_port()
    running = await proxy_for("http://127.0.0.1:1", upstream_metrics="off", server_traces=True,
                              server_traces_wait_s=5.0, admin_listen=HostPort("127.0.0.1", admin))
    server = TracedVllm(vllm_model, ("--otlp-traces-endpoint", f"http://127.0.0.1:{admin}/v1/traces"))
    await asyncio.to_thread(server.start, tmp_path / "vllm.log")  # its warm-up's spans reach the receiver
    try:
        traces = running.serving.traces
        assert traces is not None
        for _ in range(200):  # its batch exporter sends every 100 ms
            if traces.expecting:
                break
            await asyncio.sleep(0.05)
        assert traces.expecting, "vLLM's warm-up sent no span"
        await running.close()
        running = await proxy_for(server.url, upstream_metrics="vllm", server_traces=True, server_traces_wait_s=5.0,
                                  admin_listen=HostPort("127.0.0.1", admin))
        async with openai.AsyncOpenAI(base_url=f"{running.proxy_url}/v1", api_key="unused", max_retries=0) as client:
            await stream(client, "warm", 4)  # a span arrives: records wait for theirs from now on
            for _ in range(100):
                if running.serving.traces.expecting:
                    break
                await asyncio.sleep(0.05)
            # eight concurrent streams without usage at max_tokens 200: the budget, by vLLM's own count
            budget = [f"budget-{uuid.uuid4().hex[:8]}" for _ in range(MAX_NUM_SEQS)]
            await asyncio.gather(*(stream(client, rid, 200) for rid in budget))
            for rid in budget:
                record = await joined(running, rid)
                assert (record.stop_reason, record.length_cause, record.length_cause_source) == (
                    "length", "requested_budget", "server_trace"), record
                assert (record.output_tokens, record.tokens_source, record.server_trace) == (
                    200, "server_trace", "joined")
                assert record.queue_time_source == "server_trace" and record.queue_time_s is not None
                assert record.server_prefill_s is not None and record.server_decode_s is not None
            # a clamp near max_model_len without usage: the server's limit, by its own count
            clamp = f"clamp-{uuid.uuid4().hex[:8]}"
            await stream(client, clamp, 300, LONG_PROMPT)
            record = await joined(running, clamp)
            assert (record.stop_reason, record.length_cause, record.length_cause_source) == (
                "length", "server_limit", "server_trace"), record
            assert record.output_tokens == 188 and record.prompt_tokens == 324
            # more requests than --max-num-seqs: those behind waited in vLLM's queue, as its span says
            queued = [f"queued-{uuid.uuid4().hex[:8]}" for _ in range(MAX_NUM_SEQS + 4)]
            await asyncio.gather(*(stream(client, rid, 60) for rid in queued))
            waits = [(await joined(running, rid)).queue_time_s or 0.0 for rid in queued]
            assert max(waits) > 0.0, waits
            # a client that leaves mid-stream: vLLM aborts the request and sends no span
            left = f"left-{uuid.uuid4().hex[:8]}"
            await stream(client, left, 200, leave_after=5)
            record = await joined(running, left)
            assert record.client_disconnected and record.server_trace == "missing", record
            assert record.server_aborted is None and "aborted" in (record.server_trace_detail or "")
    finally:
        await asyncio.to_thread(server.stop)
