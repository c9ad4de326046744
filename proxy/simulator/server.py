"""The simulator's HTTP face: vLLM's OpenAI, Anthropic Messages and Responses APIs, and Ollama's own."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from proxy.simulator import anthropic_wire, ollama_wire, openai_wire, responses_wire
from proxy.simulator.driver import EngineDriver, SequenceStream
from proxy.simulator.engine import EngineCore, Output, Rejected, Scheduled, SequenceFinish
from proxy.simulator.faults import FAULT_HEADER, FaultError, Faults, parse_faults
from proxy.simulator.generation import GenerationRequest, WireError
from proxy.simulator.settings import SimulatorConfig
from proxy.simulator.vllm_metrics import metrics_registry, render

VLLM_VERSION = "0.11.0"
# Ollama's text when its queue is full (server/sched.go ErrMaxQueue); used for `reject`.
OLLAMA_BUSY = "server busy, please try again.  maximum pending requests exceeded"

CONFIG_KEY = web.AppKey("sim_config", SimulatorConfig)
DRIVER_KEY = web.AppKey("sim_driver", EngineDriver)
REGISTRY_KEY = web.AppKey("sim_registry", CollectorRegistry)


class WireFormat(Protocol):
    """One dialect's encoder for one response (OpenAIStream, OllamaStream)."""

    content_type: str

    def begin(self) -> bytes: ...
    def chunk(self, text: str, finish: SequenceFinish | None) -> bytes: ...
    def end(self, finish: SequenceFinish, timings: dict[str, int]) -> bytes: ...
    def error(self, message: str, status: int = 500) -> bytes: ...
    def body(self, text: str, finish: SequenceFinish, timings: dict[str, int]) -> dict[str, Any]: ...
    def error_body(self, status: int, message: str, param: str | None = None) -> dict[str, Any]: ...


def json_response(body: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def cut_connection(request: web.Request) -> None:
    """Close the TCP connection with no final event: the client sees an incomplete body."""
    if request.transport is not None:
        request.transport.close()


@dataclass(slots=True)
class _Progress:
    """What one response has sent so far, for faults and Ollama's durations."""

    tokens_sent: int = 0
    stalled: bool = False
    scheduled_at: float | None = None
    first_output_at: float | None = None


async def _fault_before_output(request: web.Request, faults: Faults, progress: _Progress) -> str | None:
    """Apply the faults due before the next output: returns `cut`, `error` or None."""
    if faults.cut_after is not None and progress.tokens_sent >= faults.cut_after:
        return "cut"
    if faults.error_after is not None and progress.tokens_sent >= faults.error_after:
        return "error"
    if faults.stall_after is not None and not progress.stalled and progress.tokens_sent >= faults.stall_after:
        progress.stalled = True
        await asyncio.sleep(faults.stall_s)
    return None


async def _outputs(stream: SequenceStream, progress: _Progress) -> AsyncIterator[Output]:
    """The sequence's outputs, noting when it was first scheduled."""
    while True:
        event = await stream.queue.get()
        if isinstance(event, Scheduled):
            if progress.scheduled_at is None:
                progress.scheduled_at = time.monotonic()
        elif isinstance(event, Output):
            if progress.first_output_at is None:
                progress.first_output_at = time.monotonic()
            yield event
            if event.finish is not None:
                return


async def generate(request: web.Request, fmt: WireFormat, parsed: GenerationRequest,
                   faults: Faults) -> web.StreamResponse:
    """Run one generation through the engine and write it in `fmt`, streamed or whole."""
    config, driver = request.app[CONFIG_KEY], request.app[DRIVER_KEY]
    admission = driver.submit(parsed.spec(config))
    if isinstance(admission, Rejected):
        message = admission.message
        status = admission.status
        if admission.kind == "kv_full" and isinstance(fmt, ollama_wire.OllamaStream):
            message = OLLAMA_BUSY
        if admission.kind == "kv_full" and isinstance(fmt, anthropic_wire.AnthropicStream):
            status = anthropic_wire.OVERLOADED_STATUS  # Anthropic's way of saying "too busy"
        return json_response(fmt.error_body(status, message), status)
    stream, progress = admission, _Progress()
    try:
        if parsed.stream:
            return await _stream_response(request, fmt, stream, faults, progress)
        return await _whole_response(request, fmt, stream, faults, progress)
    finally:
        driver.abort(stream)  # a no-op once the sequence has finished


async def _stream_response(request: web.Request, fmt: WireFormat, stream: SequenceStream, faults: Faults,
                           progress: _Progress) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": fmt.content_type})
    await response.prepare(request)
    # A client that goes away mid-answer is no error: the caller frees the sequence; nothing to log.
    with contextlib.suppress(ConnectionResetError):
        await _write_stream(request, response, fmt, stream, faults, progress)
    return response


async def _write_stream(request: web.Request, response: web.StreamResponse, fmt: WireFormat,
                        stream: SequenceStream, faults: Faults, progress: _Progress) -> None:
    if head := fmt.begin():
        await response.write(head)
    async for output in _outputs(stream, progress):
        fault = await _fault_before_output(request, faults, progress)
        if fault == "cut":
            cut_connection(request)
            return
        if fault == "error":
            await response.write(fmt.error(faults.error_message))
            break
        data = fmt.chunk(output.text, output.finish)
        if output.finish is not None:
            data += fmt.end(output.finish, _timings(stream, progress))
        await response.write(data)
        if output.text:
            progress.tokens_sent += 1
    await response.write_eof()


async def _whole_response(request: web.Request, fmt: WireFormat, stream: SequenceStream, faults: Faults,
                          progress: _Progress) -> web.StreamResponse:
    parts: list[str] = []
    async for output in _outputs(stream, progress):
        if request.transport is None or request.transport.is_closing():
            return web.Response(status=499)  # the client left: never sent; the caller frees the sequence
        fault = await _fault_before_output(request, faults, progress)
        if fault == "cut":
            cut_connection(request)
            return web.Response(status=500)  # never sent: the connection is closed
        if fault == "error":
            return json_response(fmt.error_body(500, faults.error_message), 500)
        parts.append(output.text)
        if output.text:
            progress.tokens_sent += 1
        if output.finish is not None:
            return json_response(fmt.body("".join(parts), output.finish, _timings(stream, progress)))
    raise AssertionError("the engine ended a sequence without a finish")  # pragma: no cover


def _timings(stream: SequenceStream, progress: _Progress) -> dict[str, int]:
    return ollama_wire.timings_ns(stream.arrived_at, progress.scheduled_at, progress.first_output_at,
                                  time.monotonic())


async def _read_body(request: web.Request) -> Any:
    try:
        return orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise WireError(400, f"invalid JSON body: {exc}") from None


def _faults(request: web.Request) -> Faults:
    try:
        return parse_faults(request.headers.get(FAULT_HEADER))
    except FaultError as exc:
        raise WireError(400, str(exc)) from None


async def _serve(request: web.Request, fmt: WireFormat, parsed: GenerationRequest,
                 faults: Faults) -> web.StreamResponse:
    """Common to the four generation routes once the body is read: `status=`, then generate."""
    if faults.status is not None:
        return json_response(fmt.error_body(faults.status, f"simulated failure ({FAULT_HEADER})"), faults.status)
    return await generate(request, fmt, parsed, faults)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve_openai(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve_openai(request, "completion")


async def _serve_openai(request: web.Request, kind: openai_wire.Kind) -> web.StreamResponse:
    model = request.app[CONFIG_KEY].model
    fmt = openai_wire.OpenAIStream(kind, model, include_usage=False)
    try:
        faults = _faults(request)
        parsed = openai_wire.parse_request(kind, await _read_body(request), model)
    except WireError as exc:
        return json_response(fmt.error_body(exc.status, exc.message, exc.param), exc.status)
    fmt.include_usage = parsed.include_usage
    return await _serve(request, fmt, parsed, faults)


async def messages(request: web.Request) -> web.StreamResponse:
    """Anthropic's /v1/messages."""
    model = request.app[CONFIG_KEY].model
    try:
        faults = _faults(request)
        parsed = anthropic_wire.parse_request(await _read_body(request), model)
    except WireError as exc:
        return json_response(anthropic_wire.error_body(exc.status, exc.message), exc.status)
    return await _serve(request, anthropic_wire.AnthropicStream(model, parsed.prompt_tokens), parsed, faults)


async def responses(request: web.Request) -> web.StreamResponse:
    """OpenAI's /v1/responses."""
    model = request.app[CONFIG_KEY].model
    try:
        faults = _faults(request)
        parsed = responses_wire.parse_request(await _read_body(request), model)
    except WireError as exc:
        return json_response(responses_wire.ResponsesStream.error_body(exc.status, exc.message, exc.param),
                             exc.status)
    return await _serve(request, responses_wire.ResponsesStream(model, parsed.requested_tokens), parsed, faults)


async def ollama_chat(request: web.Request) -> web.StreamResponse:
    return await _serve_ollama(request, "chat")


async def ollama_generate(request: web.Request) -> web.StreamResponse:
    return await _serve_ollama(request, "generate")


async def _serve_ollama(request: web.Request, kind: ollama_wire.Kind) -> web.StreamResponse:
    model = request.app[CONFIG_KEY].model
    try:
        faults = _faults(request)
        parsed = ollama_wire.parse_request(kind, await _read_body(request), model)
    except WireError as exc:
        return json_response(ollama_wire.error_body(exc.status, exc.message), exc.status)
    fmt = ollama_wire.OllamaStream(kind, parsed.model)
    if parsed.prompt_tokens == 0 and faults.status is None:  # Ollama loads the model, answers at once
        body = fmt.load_body()
        if not parsed.stream:
            return json_response(body)
        return web.Response(body=orjson.dumps(body) + b"\n", content_type=ollama_wire.NDJSON_CONTENT_TYPE)
    return await _serve(request, fmt, parsed, faults)


async def list_models(request: web.Request) -> web.Response:
    config = request.app[CONFIG_KEY]
    return json_response(openai_wire.models_body(config.model, config.ctx_size, int(time.time())))


async def ollama_tags(request: web.Request) -> web.Response:
    return json_response(ollama_wire.tags_body(request.app[CONFIG_KEY].model, ollama_wire.created_at()))


async def ollama_ps(request: web.Request) -> web.Response:
    config = request.app[CONFIG_KEY]
    return json_response(ollama_wire.ps_body(config.model, config.slot_ctx_tokens or config.ctx_size))


async def ollama_version(request: web.Request) -> web.Response:
    return json_response({"version": ollama_wire.OLLAMA_VERSION})


async def vllm_version(request: web.Request) -> web.Response:
    return json_response({"version": VLLM_VERSION})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def root(request: web.Request) -> web.Response:
    return web.Response(text="Ollama is running")


async def metrics(request: web.Request) -> web.Response:
    response = web.Response(body=render(request.app[REGISTRY_KEY]))
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response


def build_app(config: SimulatorConfig) -> web.Application:
    """The simulator as an aiohttp Application; its engine loop runs while the app does."""
    app = web.Application()
    core = EngineCore(config)
    driver = EngineDriver(core)
    app[CONFIG_KEY] = config
    app[DRIVER_KEY] = driver
    app[REGISTRY_KEY] = metrics_registry(core)

    async def engine_loop(app: web.Application) -> AsyncIterator[None]:
        driver.start()
        yield
        await driver.stop()

    app.cleanup_ctx.append(engine_loop)
    add = app.router
    add.add_post("/v1/chat/completions", chat_completions)
    add.add_post("/v1/completions", completions)
    add.add_post("/v1/messages", messages)
    add.add_post("/v1/responses", responses)
    add.add_get("/v1/models", list_models)
    add.add_post("/api/chat", ollama_chat)
    add.add_post("/api/generate", ollama_generate)
    add.add_get("/api/tags", ollama_tags)
    add.add_get("/api/ps", ollama_ps)
    add.add_get("/api/version", ollama_version)
    add.add_get("/version", vllm_version)
    add.add_get("/health", health)
    add.add_get("/metrics", metrics)
    add.add_get("/", root)
    return app


class RunningSimulator:
    """A simulator listening on a loopback port; `url` is its base URL."""

    def __init__(self, runner: web.AppRunner, app: web.Application, host: str, port: int) -> None:
        self._runner = runner
        self.app = app
        self.host = host
        self.port = port
        self.url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"

    @property
    def engine(self) -> EngineCore:
        """The engine, for tests that check its counters."""
        return self.app[DRIVER_KEY].core

    async def close(self) -> None:
        await self._runner.cleanup()

    async def __aenter__(self) -> RunningSimulator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def start_simulator(config: SimulatorConfig, host: str = "127.0.0.1", port: int = 0) -> RunningSimulator:
    """Start the simulator on host:port (0 = a free port) and return once it listens."""
    app = build_app(config)
    # a simulator stops at once on SIGTERM: open streams get 1 s, not aiohttp's default 60
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_port = runner.addresses[0][1]
    return RunningSimulator(runner, app, host, int(bound_port))
