"""A fake llama-server in router mode (`--models-dir`, `--models-max 1`) that swaps models under a
running answer, for the tests.

Built from llama.cpp's source (tools/server/server-models.cpp, 2026-08) and its reported wire:
- the bare `GET /props` says `role: router`; `GET /props?model=NAME&autoload=false` is that model's
  own `/props` (`default_generation_settings.n_ctx`, `total_slots`);
- `GET /v1/models` lists every model with its `status.value` (`loaded`, `unloaded`, `loading`);
- a bare `GET /metrics` answers 400 ("model name is missing"), `?model=NAME` a loaded model's own;
- with `--models-max 1`, a request for another model unloads the running one, and its child
  process goes with its running requests: their streams break (llama.cpp#22447, #24849).
  (The bundled build the real-server tests run, 0.3.36, waits for the running answer instead.)
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support.loopback_app import LoopbackApp

METRICS = """# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing {processing}
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""


@dataclass
class FakeRouter(LoopbackApp):
    models: dict[str, str] = field(default_factory=lambda: {"coder": "loaded", "writer": "unloaded"})
    answer: int = 20  # content chunks of each answer, then `stop`
    token_delay_s: float = 0.02
    swap_to: str | None = None  # at half an answer, this model is loaded in its place and the answer broken
    processing: int = 0
    server: TestServer | None = None

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/props", self._props)
        app.router.add_get("/v1/models", self._list)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/chat/completions", self._chat)

    async def _props(self, request: web.Request) -> web.Response:
        model = request.query.get("model")
        if model is None:
            return web.json_response({"role": "router", "default_generation_settings": {"n_ctx": 0}})
        if self.models.get(model) != "loaded":
            return web.json_response({"error": {"code": 400, "message": "model is not loaded",
                                                "type": "invalid_request_error"}}, status=400)
        return web.json_response({"default_generation_settings": {"n_ctx": 4096}, "total_slots": 1,
                                  "model_path": f"/models/{model}.gguf"})

    async def _list(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "owned_by": "llamacpp", "created": 1796000000,
             "status": {"value": status}} for name, status in self.models.items()]})

    async def _metrics(self, request: web.Request) -> web.Response:
        model = request.query.get("model")
        if model is None:
            return web.json_response({"error": {"code": 400, "message": "model name is missing",
                                                "type": "invalid_request_error"}}, status=400)
        return web.Response(text=METRICS.format(processing=self.processing if self.models.get(model) == "loaded"
                                                else 0))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = orjson.loads(await request.read())
        model = body["model"]
        base = {"id": "chatcmpl-router", "object": "chat.completion.chunk", "created": 1796000000, "model": model,
                "system_fingerprint": "b9775"}
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        self.processing += 1
        try:
            for number in range(self.answer):
                await asyncio.sleep(self.token_delay_s)
                delta = {"role": "assistant", "content": None} if number == 0 else {"content": f"w{number} "}
                await response.write(b"data: " + orjson.dumps(
                    {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}) + b"\n\n")
                if self.swap_to is not None and number == self.answer // 2:
                    # Another model's request arrives: the running one is unloaded and its child
                    # process killed, its answers with it.
                    self.models = {name: "loaded" if name == self.swap_to else "unloaded" for name in self.models}
                    await asyncio.sleep(0.3)
                    assert request.transport is not None
                    request.transport.close()
                    return response
            await response.write(b"data: " + orjson.dumps(
                {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            self.processing -= 1
