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

With `traces_to` it exports one `llm_request` span per request it finishes, through the real
OpenTelemetry SDK and OTLP/HTTP exporter, as vLLM's `OutputProcessor.do_tracing` does
(v1/engine/output_processor.py; vllm/tracing/otel.py: a BatchSpanProcessor, the span started at the
request's arrival, kind SERVER, the client's traceparent as its context): `gen_ai.request.id`
`chatcmpl-<X-Request-Id>`, the prompt and generated tokens, `max_tokens` where given, the queue,
TTFT, e2e, prefill and decode times. A request it aborts because its client left gets none.
`max_num_seqs` runs that many at once and queues the rest (the queue time the span says).
`break_after` breaks the stream after that many tokens while the engine finishes the answer (a cut
between the server and the proxy); `ignore_disconnect` keeps generating after the client left.
"""

from __future__ import annotations

import asyncio
import time
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
    traces_to: str | None = None  # an OTLP/HTTP traces endpoint: a span per finished request
    max_num_seqs: int = 256
    break_after: int | None = None
    ignore_disconnect: bool = False
    metrics_in_answer: bool = False  # --enable-per-request-metrics: `metrics` in the usage chunk
    server: TestServer | None = None
    _tracer: Any = field(default=None, repr=False)
    _provider: Any = field(default=None, repr=False)
    _running: asyncio.Semaphore | None = field(default=None, repr=False)

    async def close(self) -> None:
        await super().close()
        if self._provider is not None:
            self._provider.shutdown()

    def _trace(self, request_headers: Any, attributes: dict[str, Any], arrival_ns: int) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if self._tracer is None:
            self._provider = TracerProvider(resource=Resource.create({"vllm.process_id": "1"}))
            self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=self.traces_to),
                                                                 schedule_delay_millis=20))
            self._tracer = self._provider.get_tracer("vllm.llm_engine")
        headers = {k.lower(): v for k, v in request_headers.items() if k.lower() in ("traceparent", "tracestate")}
        context = TraceContextTextMapPropagator().extract(headers) if headers else None
        span = self._tracer.start_span("llm_request", kind=SpanKind.SERVER, start_time=arrival_ns,
                                       attributes=attributes, context=context)
        span.end()

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
        arrival, arrival_ns = time.monotonic(), time.time_ns()
        if self._running is None:
            self._running = asyncio.Semaphore(self.max_num_seqs)
        async with self._running:
            return await self._answer(request, arrival, arrival_ns)

    async def _answer(self, request: web.Request, arrival: float, arrival_ns: int) -> web.StreamResponse:
        scheduled = time.monotonic()
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

        first_token = last_token = time.monotonic()
        writing, made = True, 0
        try:
            await send({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None})
            for i in range(budget):
                await asyncio.sleep(self.token_delay_s)
                last_token, made = time.monotonic(), i + 1
                if i == 0:
                    first_token = last_token
                if not writing:
                    continue
                if self.break_after is not None and i == self.break_after:
                    # The answer goes on in the engine, and is traced when it ends; its way out is cut.
                    left = (budget - i) * self.token_delay_s
                    attributes = self._attributes(request, arrival, scheduled, first_token, first_token + left,
                                                  prompt, budget, asked)
                    asyncio.get_running_loop().call_later(left, self._trace, request.headers.copy(), attributes,
                                                          arrival_ns)
                    assert request.transport is not None
                    request.transport.close()
                    return response
                await send({"index": 0, "delta": {"content": "" if i % 3 == 2 else f"w{i} "}, "logprobs": None,
                            "finish_reason": None})
            if writing:
                await send({"index": 0, "delta": {"content": ""}, "logprobs": None, "finish_reason": "length",
                            "stop_reason": None})
                if (body.get("stream_options") or {}).get("include_usage"):
                    usage: dict[str, Any] = {**base, "choices": [], "usage": {
                        "prompt_tokens": prompt, "total_tokens": prompt + budget, "completion_tokens": budget}}
                    if self.metrics_in_answer:
                        usage["metrics"] = {"time_to_first_token_ms": (first_token - scheduled) * 1000,
                                            "generation_time_ms": (last_token - first_token) * 1000,
                                            "queue_time_ms": (scheduled - arrival) * 1000,
                                            "mean_itl_ms": 0.5, "tokens_per_second": 2000.0}
                    await response.write(b"data: " + orjson.dumps(usage) + b"\n\n")
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            # The client left: vLLM aborts the request, and traces none. A server that does not
            # notice goes on to the end of the answer, and traces it then.
            if self.ignore_disconnect and self.traces_to is not None:
                left = (budget - made) * self.token_delay_s
                attributes = self._attributes(request, arrival, scheduled, first_token, last_token + left, prompt,
                                              budget, asked)
                asyncio.get_running_loop().call_later(left, self._trace, request.headers.copy(), attributes,
                                                      arrival_ns)
            raise
        if self.traces_to is not None:
            attributes = self._attributes(request, arrival, scheduled, first_token, last_token, prompt, budget, asked)
            self._trace(request.headers, attributes, arrival_ns)
        return response

    @staticmethod
    def _attributes(request: web.Request, arrival: float, scheduled: float, first_token: float, last_token: float,
                    prompt: int, budget: int, asked: int | None) -> dict[str, Any]:
        attributes: dict[str, Any] = {
            "gen_ai.latency.time_to_first_token": first_token - arrival, "gen_ai.latency.e2e": last_token - arrival,
            "gen_ai.latency.time_in_queue": scheduled - arrival, "gen_ai.usage.prompt_tokens": prompt,
            "gen_ai.usage.completion_tokens": budget,
            "gen_ai.latency.time_in_model_prefill": first_token - scheduled,
            "gen_ai.latency.time_in_model_decode": last_token - first_token,
            "gen_ai.latency.time_in_model_inference": last_token - scheduled,
            "gen_ai.request.id": "chatcmpl-" + request.headers.get("X-Request-Id", "random"),
            "gen_ai.request.n": 1}
        if asked is not None:
            attributes["gen_ai.request.max_tokens"] = asked
        return attributes
