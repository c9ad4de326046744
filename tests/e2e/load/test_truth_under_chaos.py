"""Truth under chaos: hundreds of answers at once, in every dialect the proxy reads, the upstream
cutting some of them, the clients reading whole, slowly, leaving after a few bytes or before the
head; the proxy as users run it (its own process), with two workers, and with the admission gate.

Each record must say what its own wire said, whatever the others did at the same moment, and every
whole read must be the upstream's bytes exactly. (Written as a probe on 2026-12-07, when it found
nothing: it guards the workers' and the gate's paths against a record that takes another exchange's
end, or an end of its own it did not have.)
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.support.proxies import start_served
from tests.support.wire import (
    anthropic_message,
    anthropic_stream,
    ollama_stream,
    openai_completion,
    openai_stream,
    responses_body,
    responses_stream,
)

pytestmark = [pytest.mark.load, pytest.mark.timeout(180)]

REQUESTS = 600
CONCURRENT = 60
SSE, NDJSON, JSON = "text/event-stream", "application/x-ndjson", "application/json"


@dataclass(frozen=True)
class Kind:
    """One kind of answer: where it is asked, what the upstream sends, and the record's stop for it."""

    path: str
    body: Callable[[], list[bytes]]
    media: str
    stop: str
    status: int = 200
    method: str = "POST"
    cut: bool = False  # the upstream breaks the connection after `body` (no end of its own)

    @property
    def streamed(self) -> bool:
        return self.status == 200 and self.media != JSON


KINDS = {
    "openai": Kind("/v1/chat/completions", lambda: openai_stream(20), SSE, "eos"),
    "openai_length": Kind("/v1/chat/completions", lambda: openai_stream(20, "length"), SSE, "length"),
    "openai_cut": Kind("/v1/chat/completions", lambda: openai_stream(20)[:6], SSE, "upstream_disconnect", cut=True),
    "openai_whole": Kind("/v1/chat/completions", lambda: [openai_completion(12)], JSON, "eos"),
    "anthropic": Kind("/v1/messages", lambda: anthropic_stream(20), SSE, "eos"),
    "anthropic_length": Kind("/v1/messages", lambda: anthropic_stream(20, "max_tokens"), SSE, "length"),
    "anthropic_cut": Kind("/v1/messages", lambda: anthropic_stream(20)[:5], SSE, "upstream_disconnect", cut=True),
    "anthropic_whole": Kind("/v1/messages", lambda: [anthropic_message(9)], JSON, "eos"),
    "ollama": Kind("/api/chat", lambda: ollama_stream(20), NDJSON, "eos"),
    "ollama_length": Kind("/api/chat", lambda: ollama_stream(20, "length"), NDJSON, "length"),
    "ollama_cut": Kind("/api/chat", lambda: ollama_stream(20)[:7], NDJSON, "upstream_disconnect", cut=True),
    "responses": Kind("/v1/responses", lambda: responses_stream(15), SSE, "eos"),
    "responses_whole": Kind("/v1/responses", lambda: [responses_body(8)], JSON, "eos"),
    "busy": Kind("/v1/chat/completions", lambda: [b'{"error":{"message":"busy"}}'], JSON, "rejected", status=429),
    "failed": Kind("/v1/chat/completions", lambda: [b'{"error":{"message":"boom"}}'], JSON, "upstream_error",
                   status=500),
    "models": Kind("/v1/models", lambda: [b'{"object":"list","data":[{"id":"m"}]}'], JSON, "not_inference",
                   method="GET"),
}
HI = [{"role": "user", "content": "hi"}]
ASKED: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "m", "stream": True, "max_tokens": 20, "messages": HI},
    "/v1/messages": {"model": "m", "stream": True, "max_tokens": 20, "messages": HI},
    "/api/chat": {"model": "m", "messages": HI, "options": {"num_predict": 20}},
    "/v1/responses": {"model": "m", "stream": True, "input": "hi", "max_output_tokens": 20},
}
MODES = ("whole", "whole", "slow", "leave", "abandon")


class Upstream:
    """Answers each request as its X-Request-Id (`kind/mode/n`, forwarded by the proxy) says, and
    keeps what it sent for each."""

    def __init__(self) -> None:
        self.sent: dict[str, bytes] = {}
        self.seen: set[str] = set()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.answer)
        self.runner = web.AppRunner(app, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def answer(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers["X-Request-Id"]
        self.seen.add(rid)
        kind = KINDS[rid.split("/")[0]]
        await request.read()
        pieces = kind.body()
        if not kind.streamed:
            self.sent[rid] = b"".join(pieces)
            return web.Response(status=kind.status, body=self.sent[rid], content_type=kind.media)
        response = web.StreamResponse(headers={"Content-Type": kind.media})
        response.enable_chunked_encoding()
        pace = random.Random(rid)
        try:
            await response.prepare(request)
            sent = b""
            for piece in pieces:
                await asyncio.sleep(pace.random() * 0.01)
                await response.write(piece)
                sent += piece
            self.sent[rid] = sent
            if kind.cut:
                assert request.transport is not None
                request.transport.abort()
            else:
                await response.write_eof()
        except ConnectionError:  # the proxy closed it: its client left
            pass
        return response


async def ask(url: str, rid: str, mode: str, got: dict[str, bytes | None]) -> None:
    """One client: `got[rid]` is the body it read whole, or None when its connection broke."""
    kind = KINDS[rid.split("/")[0]]
    options: dict[str, Any] = {"json": ASKED[kind.path]} if kind.method == "POST" else {}
    pace = random.Random(rid)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        if mode == "abandon":  # gone before the head, perhaps before the request was whole
            with contextlib.suppress(asyncio.TimeoutError, aiohttp.ClientError):
                response = await asyncio.wait_for(session.request(kind.method, url + kind.path,
                                                                  headers={"X-Request-Id": rid}, **options),
                                                  pace.random() * 0.02)
                response.close()  # (answered that fast: it leaves at once all the same)
            return
        try:
            async with session.request(kind.method, url + kind.path, headers={"X-Request-Id": rid},
                                       **options) as response:
                if mode == "leave":
                    await response.content.read(pace.randrange(1, 200))
                    return
                body = b""
                while chunk := await response.content.read(64 if mode == "slow" else 65536):
                    body += chunk
                    if mode == "slow":
                        await asyncio.sleep(0.003)
                got[rid] = body
        except aiohttp.ClientPayloadError:
            got[rid] = None


@pytest.mark.parametrize("flags,workers", [((), 2), (("--max-in-flight", "8"), 1)], ids=["two-workers", "gated"])
async def test_every_record_says_what_its_own_wire_said(flags: tuple[str, ...], workers: int, tmp_path: Path) -> None:
    upstream = Upstream()
    await upstream.start()
    served = await start_served(upstream.url, tmp_path, "--history", "off", *flags, workers=workers)
    plan = random.Random(44)
    asked = [f"{plan.choice(list(KINDS))}/{plan.choice(MODES)}/{n}" for n in range(REQUESTS)]
    got: dict[str, bytes | None] = {}
    places = asyncio.Semaphore(CONCURRENT)

    async def one(rid: str) -> None:
        async with places:
            await ask(served.proxy_url.rstrip("/"), rid, rid.split("/")[1], got)

    try:
        await asyncio.gather(*(one(rid) for rid in asked))
    finally:
        served.stop()
        await upstream.close()
    lines = served.lines()
    records = {line["request_id"]: line for line in lines if line.get("event") == "response"}
    wrong: Counter[str] = Counter()
    for rid in asked:
        name, mode, _ = rid.split("/")
        kind = KINDS[name]
        record = records.get(rid)
        if record is None:
            if rid in upstream.seen:  # (an abandoned request the proxy never had whole has no record)
                wrong[f"{name}/{mode}: no record"] += 1
            continue
        stop = record["stop_reason"]
        if mode in ("whole", "slow"):
            body = got.get(rid, b"<none>")
            if stop != kind.stop:
                wrong[f"{name}/{mode}: {stop}"] += 1
            if (body is None) != kind.cut or (body is not None and body != upstream.sent.get(rid)):
                wrong[f"{name}/{mode}: bytes"] += 1
        elif stop not in ("client_disconnect", kind.stop):
            wrong[f"{name}/{mode}: {stop}"] += 1
    assert not wrong, wrong
    assert sum(1 for rid in asked if rid in records) >= REQUESTS * 3 // 4  # (most: abandons aside)
    assert {rid.split("/")[0] for rid in asked if rid.split("/")[1] == "whole"} == set(KINDS)
    failures = [line for line in lines if line.get("level") in ("error", "critical")]
    assert failures == [], failures[:3]
