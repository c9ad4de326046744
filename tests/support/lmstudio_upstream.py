"""A fake LM Studio whose JIT auto-evict unloads a model before its answer ends (lmstudio-bug-tracker
#1796), for the tests.

Built from LM Studio's documented REST API (lmstudio-ai/docs, developer/rest/endpoints, v0): `GET
/api/v0/models` lists each model with `state` `loaded` or `not-loaded` and its `max_context_length`;
no `/metrics`, no `/api/ps` (both 404). Its OpenAI-compatible chat streams `chat.completion.chunk`s;
an evicted model's stream ends without a finish reason.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support.loopback_app import LoopbackApp


@dataclass
class FakeLMStudio(LoopbackApp):
    models: dict[str, str] = field(default_factory=lambda: {"qwen3-8b": "loaded", "gemma-3-4b": "not-loaded"})
    answer: int = 20
    token_delay_s: float = 0.02
    evict_mid_answer: bool = False
    server: TestServer | None = None

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/api/v0/models", self._list)
        app.router.add_post("/v1/chat/completions", self._chat)

    async def _list(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "type": "llm", "publisher": "lmstudio-community", "arch": "qwen3",
             "compatibility_type": "gguf", "quantization": "Q4_K_M", "state": state, "max_context_length": 32768}
            for name, state in self.models.items()]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = orjson.loads(await request.read())
        base = {"id": "chatcmpl-lms", "object": "chat.completion.chunk", "created": 1796000000,
                "model": body["model"], "system_fingerprint": body["model"]}
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for number in range(self.answer):
            await asyncio.sleep(self.token_delay_s)
            chunk = {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": f"w{number} "},
                                          "logprobs": None, "finish_reason": None}]}
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            if self.evict_mid_answer and number == self.answer // 2:
                self.models[body["model"]] = "not-loaded"
                await asyncio.sleep(0.3)
                assert request.transport is not None
                request.transport.close()
                return response
        finish = {**base, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]}
        await response.write(b"data: " + orjson.dumps(finish) + b"\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response
