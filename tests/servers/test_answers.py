"""The answers the proxy asks a server for itself are read whole, however many writes they come in:
`response.content.read(n)` returned only what was buffered, so a `/tokenize` answer in two writes 30
ms apart left every record undecided, `/v1/models` in two pieces left the server unidentified, and a
107 KB vLLM `/metrics` page in pieces set the upstream telemetry down."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.diagnosis.server_check import ServerTokenizer
from proxy.observers.metrics import ProxyMetrics
from proxy.observers.telemetry.samples import SampleRing
from proxy.observers.telemetry.server_metrics import UpstreamPoller, UpstreamState
from proxy.servers.answers import AnswerTooLarge, read_whole
from proxy.servers.base import ServerIdentity, ServerInfo, TokenizerQuery
from proxy.servers.identity import read_identity

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PIECES = 3
GAP_S = 0.03


def in_pieces(body: bytes, content_type: str = "application/json", declared: bool = True):  # type: ignore[no-untyped-def]
    """A handler that writes `body` in PIECES writes, GAP_S apart (chunked, or with its length)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": content_type})
        if declared:
            response.content_length = len(body)
        await response.prepare(request)
        step = -(-len(body) // PIECES)
        for start in range(0, len(body), step):
            await response.write(body[start:start + step])
            await asyncio.sleep(GAP_S)
        await response.write_eof()
        return response

    return handler


@pytest.fixture
async def server() -> AsyncIterator[tuple[web.Application, list[TestServer]]]:
    app = web.Application()
    started: list[TestServer] = []
    yield app, started
    for each in started:
        await each.close()


async def start(app: web.Application, started: list[TestServer]) -> str:
    test_server = TestServer(app, host="127.0.0.1")
    await test_server.start_server()
    started.append(test_server)
    return str(test_server.make_url("")).rstrip("/")


@pytest.mark.parametrize("declared", [True, False])
async def test_an_answer_in_several_writes_is_read_whole_or_refused_past_its_cap(
        server: tuple[web.Application, list[TestServer]], declared: bool) -> None:
    app, started = server
    body = b"x" * 100_000
    app.router.add_get("/big", in_pieces(body, declared=declared))
    url = await start(app, started)
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/big") as response:
            assert await read_whole(response, 200_000) == body
        async with session.get(url + "/big") as response:
            with pytest.raises(AnswerTooLarge):
                await read_whole(response, 50_000)


async def test_a_tokenizer_answer_in_pieces_decides(server: tuple[web.Application, list[TestServer]]) -> None:
    app, started = server
    answer = orjson.dumps({"count": 480, "max_model_len": 512, "tokens": list(range(480))})
    app.router.add_post("/tokenize", in_pieces(answer, declared=False))
    url = await start(app, started)
    facts = ServerIdentity("vllm", None, {"m": ServerInfo("vLLM GET /v1/models", 512)})
    query = TokenizerQuery("openai", "/v1/chat/completions", "m",
                           orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}), 40, None)
    async with aiohttp.ClientSession() as session:
        count = await ServerTokenizer(session, url).count(query, facts)
    assert (count.tokens, count.context) == (480, 512)


async def test_a_model_listing_in_pieces_identifies_the_server(
        server: tuple[web.Application, list[TestServer]]) -> None:
    app, started = server
    listing = orjson.dumps({"object": "list", "data": [
        {"id": f"model-{n}", "owned_by": "vllm", "max_model_len": 4096, "padding": "p" * 2000} for n in range(20)]})
    app.router.add_get("/v1/models", in_pieces(listing, declared=False))
    url = await start(app, started)
    async with aiohttp.ClientSession() as session:
        facts = await read_identity(session, url)
    assert facts.kind == "vllm" and facts.by_model["model-3"].context_per_request == 4096


async def test_a_large_metrics_page_in_pieces_is_read(server: tuple[web.Application, list[TestServer]]) -> None:
    app, started = server
    page = (FIXTURES / "vllm_metrics_v1_engine.txt").read_bytes()
    page += b"".join(b"# HELP filler_%d padding\n# TYPE filler_%d gauge\nfiller_%d 1\n" % (n, n, n)
                     for n in range(2500))  # past 100 KB, as a real vLLM's
    assert len(page) > 100_000
    app.router.add_get("/metrics", in_pieces(page, "text/plain; version=0.0.4", declared=False))
    url = await start(app, started)
    metrics = ProxyMetrics()
    ring: SampleRing[UpstreamState] = SampleRing(10)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        poller = UpstreamPoller(url, "vllm", 1.0, metrics, ring, session)
        assert await poller.poll_once()
    assert metrics.registry.get_sample_value("llm_proxy_upstream_telemetry_up", {"source": "vllm"}) == 1
