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
import orjson
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


async def stream(client: openai.AsyncOpenAI, rid: str, max_tokens: int | None, prompt: str = "hello") -> None:
    events = await client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, stream=True,
        extra_headers={"X-Request-Id": rid}, **GREEDY)
    async for _ in events:
        pass


async def leave_after(proxy_url: str, rid: str, max_tokens: int, events: int) -> None:
    """A client that reads `events` events of a stream and closes its socket with the rest unread
    (the kernel resets the connection at once): the openai client's own close of a stream may let
    the connection linger, and a tiny model's whole answer reach it meanwhile."""
    host, port = proxy_url.removeprefix("http://").rsplit(":", 1)
    body = orjson.dumps({"model": SERVED_NAME, "messages": [{"role": "user", "content": "hello"}],
                         "max_tokens": max_tokens, "stream": True, **GREEDY})
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"X-Request-Id: %s\r\nContent-Length: %d\r\n\r\n%s"
                     % (host.encode(), rid.encode(), len(body), body))
        seen = b""
        while seen.count(b"data: ") < events:
            chunk = await asyncio.wait_for(reader.read(65536), 30)
            assert chunk, f"the stream ended before {events} events: {seen[:300]!r}"
            seen += chunk
        assert seen.startswith(b"HTTP/1.1 200"), seen[:300]
    finally:
        writer.transport.abort()


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
            # a client that leaves mid-stream: vLLM aborts the request and sends no span. Now and then
            # vLLM sends the tiny model's whole answer in one or two writes (its outputs merged while
            # its API server was busy), all relayed before the client left: the record says so (a
            # whole answer, not a disconnect); then again.
            for _ in range(4):
                left = f"left-{uuid.uuid4().hex[:8]}"
                await leave_after(running.proxy_url, left, 200, events=5)
                record = await joined(running, left)
                if record.client_disconnected:
                    break
                assert (record.stop_reason, record.output_tokens, record.server_trace) == ("length", 200, "joined")
            assert record.client_disconnected and record.server_trace == "missing", record
            assert record.server_aborted is None and "aborted" in (record.server_trace_detail or "")
    finally:
        await asyncio.to_thread(server.stop)
