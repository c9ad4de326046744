"""Answers whose values no record could hold as they are: lone surrogates in the text a record keeps
(in bodies past orjson's size, read by the standard library's parser, which lets them through) and
integers past 64 bits that the proxy's own arithmetic would make (Anthropic's input + cached tokens,
llama.cpp's prompt_n + cache_n, each 2^64 - 1). In one process and with `--workers 2`, the history on
and off: every such answer reaches its client whole, the next request on the same connection is
answered, the record is kept (made writable) or counted lost, and the other records and the admin API
are not touched."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.serve.app import start_proxy
from tests.support.proxies import proxy_config, start_served
from tests.support.scripted_upstream import Script, ScriptedUpstream

U64 = 2**64 - 1
PAD = "p" * (300 * 1024)  # past orjson's 256 KiB: the standard library's parser reads the body
SURROGATE = "\\ud800"  # as JSON writes it: a lone surrogate once read
JSON = {"Content-Type": "application/json"}


def body(text: str) -> bytes:
    return text.encode()


# (name, path, request, the answer's bytes, status)
CASES: list[tuple[str, str, dict[str, Any], bytes, int]] = [
    ("openai finish_reason", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
     body('{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"'
          + PAD + '"},"finish_reason":"' + SURROGATE + 'length"}],"usage":{"prompt_tokens":' + str(U64)
          + ',"completion_tokens":-9223372036854775808}}'), 200),
    ("anthropic stop_reason and summed usage", "/v1/messages",
     {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]},
     body('{"id":"m","type":"message","role":"assistant","content":[{"type":"text","text":"' + PAD + '"}],'
          '"stop_reason":"' + SURROGATE + '","usage":{"input_tokens":' + str(U64) + ',"cache_read_input_tokens":'
          + str(U64) + ',"output_tokens":' + str(U64) + '}}'), 200),
    ("responses status", "/v1/responses", {"model": "m", "input": "hi"},
     body('{"id":"r","object":"response","status":"' + SURROGATE + '","incomplete_details":{"reason":"'
          + SURROGATE + '"},"output":[{"type":"message","content":[{"type":"output_text","text":"' + PAD
          + '"}]}],"usage":{"input_tokens":5,"output_tokens":' + str(U64) + '}}'), 200),
    ("ollama done_reason", "/api/chat",
     {"model": "m", "stream": False, "messages": [{"role": "user", "content": "hi"}]},
     body('{"model":"m","message":{"role":"assistant","content":"' + PAD + '"},"done":true,"done_reason":"'
          + SURROGATE + '","prompt_eval_count":-5,"eval_count":' + str(U64) + '}'), 200),
    ("llama.cpp stop_type and timings", "/completion", {"prompt": "hi", "n_predict": 5},
     body('{"content":"' + PAD + '","stop":true,"stop_type":"' + SURROGATE + '","timings":{"prompt_n":' + str(U64)
          + ',"cache_n":' + str(U64) + ',"predicted_n":' + str(U64) + '}}'), 200),
    ("an error message", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
     body('{"error":{"message":"' + SURROGATE + ' went wrong ' + PAD + '","type":"' + SURROGATE + '"}}'), 500),
    ("a stream's finish and usage", "/v1/chat/completions",
     {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
     b'data: {"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}\n\n'
     b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":'
     + str(U64).encode() + b',"completion_tokens":' + str(U64).encode() + b'}}\n\ndata: [DONE]\n\n', 200),
]
NORMAL = b'{"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}'


@pytest.fixture
async def upstream() -> AsyncIterator[ScriptedUpstream]:
    server = ScriptedUpstream()
    await server.start()
    yield server
    await server.close()


async def exercise(upstream: ScriptedUpstream, proxy_url: str, admin_url: str) -> None:
    """Every hostile answer, each followed by a normal one on the same connection; then the admin API."""
    connector = aiohttp.TCPConnector(limit=1)  # one connection, kept alive across requests
    async with aiohttp.ClientSession(connector=connector) as session:
        ids = []
        for n, (name, path, request, answer, status) in enumerate(CASES):
            content_type = "text/event-stream" if answer.startswith(b"data:") else "application/json"
            upstream.push(Script(chunks=[answer], status=status, headers={"Content-Type": content_type},
                                 content_length=True),
                          Script(chunks=[NORMAL], headers=JSON, content_length=True))
            rid = f"hostile-{n}"
            async with session.post(proxy_url + path, json=request, headers={"X-Request-Id": rid}) as response:
                assert (response.status, await response.read()) == (status, answer), name
            async with session.post(proxy_url + "/v1/chat/completions", json=CASES[0][2],
                                    headers={"X-Request-Id": f"after-{n}"}) as response:
                assert (response.status, await response.read()) == (200, NORMAL), f"the request after {name}"
            ids += [rid, f"after-{n}"]
        async with aiohttp.ClientSession() as admin:
            deadline = time.monotonic() + 10
            kept: dict[str, Any] = {}
            while len(kept) < len(ids) and time.monotonic() < deadline:
                for rid in ids:
                    if rid not in kept:
                        async with admin.get(f"{admin_url}/api/requests/{rid}") as response:
                            assert response.status in (200, 404), rid
                            if response.status == 200:
                                kept[rid] = await response.json()
                await asyncio.sleep(0.1)
            async with admin.get(f"{admin_url}/metrics") as response:
                assert response.status == 200
                text = await response.text()
            lost = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("llm_proxy_records_lost_total "))
            assert all(f"after-{n}" in kept for n in range(len(CASES)))  # the others' records untouched
            assert len(kept) + lost >= len(ids), (sorted(set(ids) - set(kept)), lost)
            for record in kept.values():
                orjson.dumps(record)  # (it came as JSON: it can be written)
                assert all(value is None or not isinstance(value, int) or -(2**63) <= value < 2**63
                           for value in record.values())
            for path in ("/api/requests?limit=500", "/api/diagnose?min_per_level=1"):
                async with admin.get(admin_url + path) as response:
                    assert response.status == 200, path
            hostile = kept.get("hostile-1")
            if hostile is not None:  # Anthropic: no sum past 64 bits, and the values left out are said
                assert hostile["prompt_tokens"] is None and "input_tokens=" in (hostile["values_ignored"] or "")


@pytest.mark.parametrize("history", [False, True])
async def test_one_process(upstream: ScriptedUpstream, tmp_path: Path, history: bool) -> None:
    proxy = await start_proxy(proxy_config(upstream.url, history_path=str(tmp_path / "h.sqlite3") if history else None))
    try:
        await exercise(upstream, proxy.proxy_url, proxy.admin_url)
    finally:
        await proxy.close()


@pytest.mark.parametrize("history", [False, True])
async def test_two_workers(upstream: ScriptedUpstream, tmp_path: Path, history: bool) -> None:
    extra = ["--history", str(tmp_path / "h.sqlite3") if history else "off"]
    served = await start_served(upstream.url, tmp_path, *extra, workers=2)
    try:
        await exercise(upstream, served.proxy_url, served.admin_url)
    finally:
        served.stop()
    assert served.process.returncode == 0
    assert "Traceback" not in served.log.read_text()
