"""A fake vLLM with its tokenizer, built from vLLM 0.32's source, for the tests of the proxy's questions.

What it reproduces (vllm/entrypoints):
- `GET /v1/models`: each model with `owned_by: "vllm"` and its `max_model_len`;
- `POST /tokenize` (serve/tokenize/protocol.py): `messages` (rendered by the chat template, with
  `add_generation_prompt`) or `prompt`, answered `{"count", "max_model_len", "tokens"}`;
- `POST /v1/chat/completions`, streamed: the budget is `min(max_tokens, max_model_len - prompt)`
  (serve/utils/api_utils.py, get_max_tokens); a `max_tokens` over max_model_len is a 400; every
  third token streams as `"content": ""` (a byte held back by the detokenizer), so a stream without
  `include_usage` counts fewer chunks than tokens, as on the real server.
Its tokenizer: two tokens per message for the template, one per word, two for the generation prompt.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support.loopback_app import LoopbackApp

MODEL = "tiny"


def prompt_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(2 + len(str(m.get("content") or "").split()) for m in body["messages"]) + 2
    return len(str(body.get("prompt") or "").split()) + 1


@dataclass
class FakeVllm(LoopbackApp):
    max_model_len: int = 512
    tokenize_status: int = 200  # 404: a server whose /tokenize is blocked
    tokenize_delay_s: float = 0.0
    token_delay_s: float = 0.0005
    tokenize_calls: int = 0
    tokenize_in_flight: int = 0
    tokenize_peak: int = 0
    tokenize_headers: list[dict[str, str]] = field(default_factory=list)
    server: TestServer | None = None

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/v1/chat/completions", self._chat)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": 1796000000, "owned_by": "vllm", "root": MODEL,
             "parent": None, "max_model_len": self.max_model_len, "permission": []}]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        self.tokenize_calls += 1
        self.tokenize_headers.append(dict(request.headers))
        self.tokenize_in_flight += 1
        self.tokenize_peak = max(self.tokenize_peak, self.tokenize_in_flight)
        try:
            await asyncio.sleep(self.tokenize_delay_s)
            if self.tokenize_status != 200:
                return web.json_response({"detail": "Not Found"}, status=self.tokenize_status)
            count = prompt_tokens(orjson.loads(await request.read()))
            return web.json_response({"count": count, "max_model_len": self.max_model_len,
                                      "tokens": list(range(count)), "token_strs": None})
        finally:
            self.tokenize_in_flight -= 1

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        prompt = prompt_tokens(body)
        asked = body.get("max_tokens")
        if asked is not None and asked > self.max_model_len:
            message = (f"'max_tokens={asked} cannot be greater than max_model_len={self.max_model_len}. "
                       "Please request fewer output tokens.'")
            return web.json_response({"error": {"message": message, "type": "BadRequestError", "param": "max_tokens",
                                                "code": 400}}, status=400)
        budget = min(asked if asked is not None else 1 << 30, self.max_model_len - prompt)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1796000000, "model": MODEL}

        async def send(choice: dict[str, Any], **extra: Any) -> None:
            await response.write(b"data: " + orjson.dumps({**base, "choices": [choice], **extra}) + b"\n\n")

        await send({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None})
        for i in range(budget):
            await asyncio.sleep(self.token_delay_s)
            await send({"index": 0, "delta": {"content": "" if i % 3 == 2 else f"w{i} "}, "logprobs": None,
                        "finish_reason": None})
        await send({"index": 0, "delta": {"content": ""}, "logprobs": None, "finish_reason": "length",
                    "stop_reason": None})
        if (body.get("stream_options") or {}).get("include_usage"):
            await response.write(b"data: " + orjson.dumps({**base, "choices": [], "usage": {
                "prompt_tokens": prompt, "total_tokens": prompt + budget, "completion_tokens": budget}}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
