"""A load-aware upstream for the sweep's tests: a real aiohttp server on loopback whose answers
depend on how many requests are in flight (the effect a sweep exists to find)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support.loopback_app import LoopbackApp
from tests.support.wire import ollama_stream, openai_stream

Answer = Callable[[int], tuple[int, str]]  # in-flight count -> (tokens, finish reason)


@dataclass
class LoadUpstream(LoopbackApp):
    """A tiny OpenAI/Ollama server: each answer's length and finish depend on how many are in flight."""

    answer: Answer = lambda in_flight: (6, "stop")
    token_delay: float = 0.002
    reject_above: int | None = None
    missing_model: bool = False
    uuid_ids_only: bool = False  # llama-cpp-python's server: an empty 400 for an X-Request-Id not a UUID
    refuse_ids: bool = False  # a server that refuses the X-Request-Id header whatever it holds
    prompt_too_long: bool = False  # every request: vLLM's 400 for a prompt over the context
    in_flight: int = 0
    peak: int = 0
    request_ids: list[str] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    server: TestServer | None = None

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_post("/api/chat", self._handle)
        app.router.add_get("/", self._root)

    async def _root(self, request: web.Request) -> web.Response:
        return web.Response(text="up")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.read())
        self.request_ids.append(request.headers.get("X-Request-Id", ""))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if self.missing_model:  # Ollama's answer to an unknown model
                return web.json_response({"error": "model 'm' not found"}, status=404)
            supplied = request.headers.get("X-Request-Id")
            if supplied is not None and (self.refuse_ids or (self.uuid_ids_only and not _is_uuid(supplied))):
                return web.Response(status=400)
            if self.prompt_too_long:
                return web.json_response({"error": {
                    "message": "This model's maximum context length is 512 tokens. However, your prompt contains "
                               "at least 600 input tokens", "type": "BadRequestError", "param": "input_tokens",
                    "code": 400}}, status=400)
            if self.reject_above is not None and self.in_flight > self.reject_above:
                return web.json_response({"error": {"message": "server busy", "type": "overloaded"}},
                                         status=429)
            tokens, finish = self.answer(self.in_flight)
            ollama = request.path == "/api/chat"
            chunks = ollama_stream(tokens, finish) if ollama else openai_stream(tokens, finish)
            response = web.StreamResponse(headers={
                "Content-Type": "application/x-ndjson" if ollama else "text/event-stream"})
            await response.prepare(request)
            for chunk in chunks:
                await asyncio.sleep(self.token_delay)
                await response.write(chunk)
            await response.write_eof()
            return response
        finally:
            self.in_flight -= 1


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value, version=4)
    except ValueError:
        return False
    return True


@contextlib.asynccontextmanager
async def running_load() -> AsyncIterator[LoadUpstream]:
    """A started LoadUpstream, closed on exit."""
    server = LoadUpstream()
    await server.start()
    try:
        yield server
    finally:
        assert server.server is not None
        await server.server.close()
