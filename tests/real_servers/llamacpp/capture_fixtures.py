"""Capture real llama-server response bodies into tests/fixtures/llamacpp/, byte for byte.

Parser tests replay these without a server. Each body is written exactly as the server sent it
(HTTP framing removed, nothing re-encoded); `index.json` says for each file which request,
which server geometry and which status and content type produced it.

Run after `bash tools/build_llama_server.sh`: `python -m tests.real_servers.llamacpp.capture_fixtures`.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from tests.real_servers.llamacpp.llama_server import REPO_ROOT, LlamaServer
from tests.real_servers.llamacpp.make_tiny_gguf import write_tiny_gguf

FIXTURES = REPO_ROOT / "tests" / "fixtures" / "llamacpp"
CTX, PARALLEL = 1024, 4  # 256 tokens per slot on the split server
PROMPT = "Tell me about llamas."
# Greedy decoding and a fixed seed: the same text on every run.
GREEDY: dict[str, Any] = {"temperature": 0, "seed": 42}
EOS_AFTER = 40  # the EOS model's chat answers: 40 characters, then EOS
STOP_WORD = "klm"  # the model writes "abcdefghijklm..." (see make_tiny_gguf.CYCLE)


@dataclass(frozen=True)
class Capture:
    """The raw outcome of one request."""

    status: int
    content_type: str
    body: bytes


async def post_raw(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Capture:
    async with session.post(url, json=body) as resp:
        raw = await resp.read()
        return Capture(resp.status, resp.headers.get("Content-Type", ""), raw)


def chat(max_tokens: int, stream: bool, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "stream": stream,
        **GREEDY,
        **extra,
    }


def messages(max_tokens: int, stream: bool, **extra: Any) -> dict[str, Any]:
    """Anthropic Messages (it has no seed; greedy decoding makes it deterministic anyway)."""
    return {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "stream": stream, "temperature": 0, **extra}


def responses(max_output_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": "tiny", "input": PROMPT, "max_output_tokens": max_output_tokens, "stream": stream,
            "temperature": 0}


def native(n_predict: int, stream: bool, **extra: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "n_predict": n_predict, "stream": stream, **GREEDY, **extra}


async def capture_all(split: LlamaServer, unified: LlamaServer, eos: LlamaServer) -> dict[str, Any]:
    index: dict[str, Any] = {}
    # A fresh connection per request: llama-server closes the connection after a streamed
    # response although it answers `Keep-Alive`, so a pooled connection can be dead on reuse.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(auto_decompress=False, connector=connector) as session:

        async def save(name: str, server: LlamaServer, path: str, body: dict[str, Any]) -> Capture:
            got = await post_raw(session, server.url + path, body)
            suffix = ".sse" if got.content_type.startswith("text/event-stream") else ".json"
            (FIXTURES / f"{name}{suffix}").write_bytes(got.body)
            index[f"{name}{suffix}"] = {
                "method": "POST",
                "path": path,
                "request": body,
                "server": {"model": server.model.name, "ctx_size": server.ctx_size, "parallel": server.parallel,
                           "slot_ctx": server.slot_ctx, "extra_args": list(server.extra_args)},
                "status": got.status,
                "content_type": got.content_type,
            }
            return got

        for stream in (False, True):
            kind = "stream" if stream else "nonstream"
            # A length stop at the requested budget, then one at the slot's context (budget 400 > 256).
            await save(f"chat_{kind}_budget", split, "/v1/chat/completions", chat(8, stream))
            await save(f"chat_{kind}_slot_limit", split, "/v1/chat/completions", chat(400, stream))
            await save(f"chat_{kind}_eos", eos, "/v1/chat/completions", chat(400, stream))
            await save(f"completions_{kind}_budget", split, "/v1/completions",
                       {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "stream": stream, **GREEDY})
            await save(f"completion_{kind}_budget", split, "/completion", native(8, stream))
            await save(f"completion_{kind}_slot_limit", split, "/completion", native(400, stream))
            await save(f"completion_{kind}_eos", eos, "/completion", native(400, stream))
            await save(f"chat_{kind}_stop_word", split, "/v1/chat/completions", chat(40, stream, stop=[STOP_WORD]))
            await save(f"completion_{kind}_stop_word", split, "/completion", native(80, stream, stop=[STOP_WORD]))
            await save(f"messages_{kind}_budget", split, "/v1/messages", messages(8, stream))
            await save(f"messages_{kind}_slot_limit", split, "/v1/messages", messages(400, stream))
            await save(f"messages_{kind}_eos", eos, "/v1/messages", messages(400, stream))
            await save(f"messages_{kind}_stop_word", split, "/v1/messages",
                       messages(40, stream, stop_sequences=[STOP_WORD]))
            await save(f"responses_{kind}_budget", split, "/v1/responses", responses(8, stream))
            await save(f"responses_{kind}_slot_limit", split, "/v1/responses", responses(400, stream))
            await save(f"responses_{kind}_eos", eos, "/v1/responses", responses(400, stream))
        await save("chat_stream_budget_usage", split, "/v1/chat/completions",
                   chat(8, True, stream_options={"include_usage": True}))

        # A prompt larger than one slot: refused before generation.
        await save("chat_nonstream_prompt_exceeds_slot", split, "/v1/chat/completions",
                   {"model": "tiny", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 8})

        # The unified pool (1024 cells for 4 slots): 4 concurrent requests wanting 420 each exhaust it.
        for stream in (False, True):
            kind = "stream" if stream else "nonstream"
            body = chat(400, stream)
            results = await asyncio.gather(
                *(post_raw(session, unified.url + "/v1/chat/completions", body) for _ in range(PARALLEL))
            )
            failed = [r for r in results if b"exceeded" in r.body]
            assert failed, f"the unified pool was not exhausted: {[r.body[-200:] for r in results]}"
            name = f"chat_{kind}_unified_pool_exhausted"
            suffix = ".sse" if stream else ".json"
            (FIXTURES / f"{name}{suffix}").write_bytes(failed[0].body)
            index[f"{name}{suffix}"] = {
                "method": "POST", "path": "/v1/chat/completions", "request": body,
                "concurrent_requests": PARALLEL,
                "server": {"model": unified.model.name, "ctx_size": unified.ctx_size, "parallel": unified.parallel,
                           "slot_ctx": unified.slot_ctx, "extra_args": list(unified.extra_args)},
                "status": failed[0].status, "content_type": failed[0].content_type,
            }  # fmt: skip
    return index


async def main_async() -> None:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_gguf(Path(tmp) / "tiny.gguf")
        eos_model = write_tiny_gguf(Path(tmp) / "tiny-eos.gguf", eos_after=EOS_AFTER)
        servers = {
            "split": LlamaServer(model, CTX, PARALLEL),
            "unified": LlamaServer(model, CTX, PARALLEL, ("--kv-unified",)),
            "eos": LlamaServer(eos_model, 512, 1),
        }
        try:
            for name, server in servers.items():
                server.start(Path(tmp) / f"{name}.log")
            index = await capture_all(servers["split"], servers["unified"], servers["eos"])
        finally:
            for server in servers.values():
                server.stop()
        split = servers["split"]
    meta = {
        "llama_server_version": split.version(),
        "model": "tests/real_servers/llamacpp/make_tiny_gguf.py (the EOS fixtures: --eos-after 40)",
        "files": index,
    }
    (FIXTURES / "index.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    print(f"wrote {len(index)} fixtures to {FIXTURES}")


if __name__ == "__main__":
    asyncio.run(main_async())
