"""The sweep's load client: closed-loop streaming requests at each concurrency level.

At level L the sweep keeps exactly L requests in flight: L slots each send a request, and
each finished one is replaced at once, until L x repeats requests have been sent (so `repeats`
is the number of requests per slot). Only the last requests of a level run with fewer in
flight; the proxy's `concurrency_mean` in each record shows what every response really saw.
Every request is the same body: prompt, budget, seed, temperature; only concurrency changes.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import aiohttp
import orjson

from proxy.diagnosis.recorder import Recorder
from proxy.diagnosis.server_check import ServerTokenizer, settle_now
from proxy.diagnosis.server_reads import read_server_facts, read_server_info
from proxy.record import record_from_dict
from proxy.sweep.answer_text import AnswerText
from proxy.sweep.open_loop import arrivals
from proxy.sweep.sample import ClientMeasure, Sample
from proxy.wire.server_facts import UNKNOWN_SERVER, ServerFacts, ServerInfo

SweepDialect = Literal["openai", "ollama", "anthropic", "responses"]
SWEEP_DIALECTS: tuple[str, ...] = SweepDialect.__args__  # type: ignore[attr-defined]
PATHS: dict[str, str] = {"openai": "/v1/chat/completions", "ollama": "/api/chat", "anthropic": "/v1/messages",
                         "responses": "/v1/responses"}
PROBE_TIMEOUT_S = 5.0
JOIN_WAIT_S = 2.0  # the proxy stores a record just after the last byte: allow it that long
JOIN_RETRY_S = 0.05
REQUEST_ID = "X-Request-Id"


class SweepError(Exception):
    """The sweep cannot go on (target or admin unreachable); shown as one line."""


@dataclass(frozen=True, slots=True)
class SweepPlan:
    """What to send, where, and at which levels."""

    target: str
    levels: tuple[int, ...]
    repeats: int
    prompt: str
    max_tokens: int
    seed: int
    model: str
    dialect: SweepDialect = "openai"
    temperature: float = 0.0
    timeout_s: float = 120.0
    admin: str | None = None
    admin_token: str | None = None
    warmup: int = 1
    rates: tuple[float, ...] = ()  # open loop (requests per second) instead of `levels`
    arrivals: Literal["constant", "poisson"] = "constant"
    rate_seconds: float = 30.0  # how long each rate sends
    slo: str | None = None  # goodput's targets, as --slo gives them (`ttft=500ms,itl=50ms,e2e=30s`)

    @property
    def path(self) -> str:
        return PATHS[self.dialect]

    @property
    def total(self) -> int:
        if self.rates:
            return sum(len(arrivals(rate, self.rate_seconds, self.arrivals, self.seed)) for rate in self.rates)
        return sum(level * self.repeats for level in self.levels)

    @property
    def open_loop(self) -> bool:
        return bool(self.rates)

    def to_dict(self) -> dict[str, Any]:
        plan = {f.name: getattr(self, f.name) for f in fields(self)}
        plan["admin_token"] = "(set)" if self.admin_token else None
        return plan


def request_body(plan: SweepPlan) -> bytes:
    """The one request body every response of the sweep answers, in the plan's dialect."""
    messages = [{"role": "user", "content": plan.prompt}]
    body: dict[str, Any]
    if plan.dialect == "ollama":
        body = {"model": plan.model, "messages": messages, "stream": True,
                "options": {"num_predict": plan.max_tokens, "seed": plan.seed,
                            "temperature": plan.temperature}}
    elif plan.dialect == "anthropic":  # the Messages API has no seed
        body = {"model": plan.model, "messages": messages, "max_tokens": plan.max_tokens,
                "temperature": plan.temperature, "stream": True}
    elif plan.dialect == "responses":
        body = {"model": plan.model, "input": plan.prompt, "max_output_tokens": plan.max_tokens,
                "temperature": plan.temperature, "stream": True}
    else:
        body = {"model": plan.model, "messages": messages, "max_tokens": plan.max_tokens,
                "seed": plan.seed, "temperature": plan.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
    return orjson.dumps(body)


@dataclass(frozen=True, slots=True)
class ServerSide:
    """What the sweep knows of the server, and its tokenizer, to read a response as the proxy does."""

    facts: ServerFacts = UNKNOWN_SERVER
    tokenizer: ServerTokenizer | None = None


async def send_one(session: aiohttp.ClientSession, plan: SweepPlan, body: bytes, request_id: str,
                   level: int, index: int, in_flight: int, *, send_id: bool = True,
                   server: ServerSide = ServerSide()) -> Sample:
    """Send one streaming request and read it from the client's side, with the proxy's own
    Recorder, so that its record is classified exactly as the proxy would; never raises.

    The request carries `request_id` in X-Request-Id (a UUID: servers such as llama-cpp-python's
    refuse anything else) unless `send_id` is False; either way, the id a proxy answers with in
    X-Request-Id is the one its record is joined by.
    """
    recorder = Recorder.start(request_id, "POST", plan.path)
    recorder.request_body(body)
    recorder.concurrency(in_flight, in_flight, float(in_flight))
    t0 = time.monotonic()
    status: int | None = None
    error: str | None = None
    text = AnswerText(plan.dialect)
    try:
        async with asyncio.timeout(plan.timeout_s or None):
            headers = {"Content-Type": "application/json"}
            if send_id:
                headers[REQUEST_ID] = request_id
            async with session.post(plan.target + plan.path, data=body, headers=headers) as response:
                status = response.status
                request_id = response.headers.get(REQUEST_ID) or request_id
                recorder.known_as(request_id)
                # aiohttp has already undone any Content-Encoding, so the parser sees plain bytes.
                recorder.response_head(status, response.headers.get("Content-Type", ""))
                async for chunk in response.content.iter_any():
                    recorder.chunk(chunk, time.monotonic())
                    text.feed(chunk)
    except aiohttp.ServerTimeoutError as exc:  # aiohttp's own connect timeout, not the sweep's --timeout
        error = f"cannot connect: {exc}"[:300]
        recorder.no_answer("timeout", error)
    except TimeoutError:
        error = f"no complete response within --timeout {plan.timeout_s:g}s; the client gave up"
        recorder.client_left(error)
    except aiohttp.ClientConnectorError as exc:
        error = f"cannot connect: {exc}"
        recorder.no_answer("connect", error)
    except aiohttp.ClientError as exc:  # a payload error, a disconnect, an OS error mid-body
        error = f"connection broke: {type(exc).__name__}: {exc}"[:300]
        if status is None:
            recorder.no_answer("reset", error)
        else:
            recorder.upstream_broke(error)
    record = recorder.finish(time.monotonic(), server=server.facts)
    measure = ClientMeasure(status=status, ttft_s=record.ttft_s, itl_mean_s=record.itl_mean_s,
                            itl_p95_s=record.itl_p95_s, chunks=recorder.tally.tokens,
                            duration_s=time.monotonic() - t0, in_flight_at_start=in_flight, error=error,
                            answer_hash=text.digest())
    query = recorder.tokenizer_query()
    if query is not None and server.tokenizer is not None and plan.admin is None:
        await settle_now(server.tokenizer, record, query, server.facts)  # the proxy's record settles itself
    return Sample(level, index, request_id, record, "client", measure)


async def run_level(session: aiohttp.ClientSession, plan: SweepPlan, level: int, *, send_id: bool = True,
                    on_done: Callable[[], None] = lambda: None, server: ServerSide = ServerSide()) -> list[Sample]:
    """Closed loop at one level: `level` slots, each replacing its finished request at once."""
    body = request_body(plan)
    total = level * plan.repeats
    counter = itertools.count()
    samples: list[Sample] = []
    in_flight = 0
    started = time.monotonic()

    async def slot() -> None:
        nonlocal in_flight
        while (index := next(counter)) < total:
            in_flight += 1
            sent = time.monotonic() - started
            sample = await send_one(session, plan, body, str(uuid.uuid4()), level, index, in_flight,
                                    send_id=send_id, server=server)
            sample.client.sent_s = sent
            in_flight -= 1
            samples.append(sample)
            on_done()

    await asyncio.gather(*(slot() for _ in range(level)))
    samples.sort(key=lambda s: s.index)
    return samples


async def run_rate(session: aiohttp.ClientSession, plan: SweepPlan, rate: float, *, send_id: bool = True,
                   on_done: Callable[[], None] = lambda: None, server: ServerSide = ServerSide()) -> list[Sample]:
    """Open loop at one rate: each request sent at its arrival time, whatever is still in flight."""
    body = request_body(plan)
    in_flight = 0
    started = time.monotonic()
    samples: list[Sample] = []

    async def one(index: int, at: float) -> None:
        nonlocal in_flight
        in_flight += 1
        sample = await send_one(session, plan, body, str(uuid.uuid4()), 0, index, in_flight, send_id=send_id,
                                server=server)
        sample.client.sent_s, sample.client.rate = at, rate
        in_flight -= 1
        samples.append(sample)
        on_done()

    tasks = []
    for index, at in enumerate(arrivals(rate, plan.rate_seconds, plan.arrivals, plan.seed)):
        delay = started + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(index, time.monotonic() - started)))
    await asyncio.gather(*tasks)
    samples.sort(key=lambda s: s.index)
    return samples


def met_level(sample: Sample) -> int:
    """The concurrency a request met, as a level: the bucket of its record's peak (1, 2, 4, ... 128)."""
    peak = max(1, sample.record.concurrency_peak)
    return min(1 << (peak.bit_length() - 1), 128)


async def join_records(session: aiohttp.ClientSession, plan: SweepPlan, samples: list[Sample]) -> None:
    """Replace each client-built record by the proxy's own (`GET {admin}/api/requests/{id}`)."""
    if plan.admin is None:
        return
    headers = {"Authorization": f"Bearer {plan.admin_token}"} if plan.admin_token else {}
    limit = asyncio.Semaphore(16)

    async def join(sample: Sample) -> None:
        async with limit:
            deadline = time.monotonic() + JOIN_WAIT_S
            while True:
                try:
                    async with session.get(f"{plan.admin}/api/requests/{sample.request_id}",
                                           headers=headers) as response:
                        if response.status == 200:
                            data = await response.json(loads=orjson.loads)
                            if not isinstance(data, dict):
                                raise TypeError("the record is not a JSON object")
                            sample.record = record_from_dict(data)
                            sample.record_source = "proxy"
                            return
                        note = f"admin API answered HTTP {response.status}"
                        if response.status != 404:
                            sample.join_note = note
                            return
                except (aiohttp.ClientError, TimeoutError, TypeError, ValueError) as exc:
                    sample.join_note = f"cannot read the proxy's record: {type(exc).__name__}: {exc}"[:300]
                    return
                if time.monotonic() >= deadline:
                    sample.join_note = "the proxy has no record of this request id (client-side record used)"
                    return
                await asyncio.sleep(JOIN_RETRY_S)

    await asyncio.gather(*(join(s) for s in samples))


async def probe(session: aiohttp.ClientSession, url: str, what: str, headers: dict[str, str]) -> None:
    """Fail early with one line when a URL cannot be reached at all (any HTTP answer is fine)."""
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            async with session.get(url, headers=headers) as response:
                await response.read()
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
        raise SweepError(f"cannot reach the {what} at {url}: {reason}") from None


@dataclass(slots=True)
class SweepRun:
    """What a sweep brought back: the responses, what the server says of its context, and notes."""

    samples: list[Sample]
    server: ServerInfo | None = None
    notes: list[str] = field(default_factory=list)


async def warm_up(session: aiohttp.ClientSession, plan: SweepPlan, body: bytes, notes: list[str]) -> bool:
    """The unrecorded first requests; returns whether requests may carry X-Request-Id.

    A refused connection ends the sweep. A 4xx that is not about the context means the request
    itself is wrong (model, dialect): one line, with the server's own reason. A server that refuses
    only the X-Request-Id header is swept without it, joined by the id the proxy answers with. A
    request too large for the server's context is no mistake of the flags but a finding: the
    sweep goes on, and the verdict reports it.
    """
    send_id = True
    for number in range(plan.warmup):
        warm = await send_one(session, plan, body, str(uuid.uuid4()), 0, number, 1, send_id=send_id)
        record = warm.record
        if record.upstream_error == "connect":
            raise SweepError(f"cannot reach the target at {plan.target}: {warm.client.error}")
        status = record.status or 0
        if not (400 <= status < 500 and status not in (408, 429)) or record.upstream_error == "exceeds_context":
            continue
        if send_id:
            retry = await send_one(session, plan, body, str(uuid.uuid4()), 0, number, 1, send_id=False)
            if (retry.record.status or 0) < 400:
                send_id = False
                notes.append(f"the target refused requests carrying X-Request-Id (HTTP {status}); sent without "
                             "it, records joined by the id the proxy answered with")
                continue
        reason = record.upstream_error_detail or f"HTTP {status} with no reason given"
        raise SweepError(f"the target refused the sweep's request (POST {plan.target}{plan.path}): "
                         f"{reason[:200]}; check --model and --dialect")
    return send_id


async def run_sweep(plan: SweepPlan, *, on_level_start: Callable[[int], None] = lambda level: None,
                    on_done: Callable[[], None] = lambda: None,
                    on_level_done: Callable[[int, int, float], None] = lambda level, n, s: None,
                    ) -> SweepRun:
    """Every level in order, after `warmup` unrecorded requests (a model load must not count)."""
    # Open loop: no bound in the client, or its queue would hold arrivals back (the load is the rates').
    connector = aiohttp.TCPConnector(limit=0 if plan.open_loop else max(plan.levels), force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=PROBE_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await probe(session, plan.target + "/", "target", {})
        if plan.admin is not None:
            await probe(session, plan.admin + "/healthz", "proxy's admin API", {})
        run = SweepRun([])
        send_id = await warm_up(session, plan, request_body(plan), run.notes)
        # After the warm-up: a llama.cpp router has loaded the model by then, and only a loaded
        # model's context can be read (a state read never loads one).
        run.server = await read_server_info(session, plan.target, plan.model)
        facts = await read_server_facts(session, plan.target, (plan.model,))
        server = ServerSide(facts, ServerTokenizer(session, plan.target))
        for number, step in enumerate(plan.rates or plan.levels):
            on_level_start(number if plan.open_loop else int(step))
            t0 = time.monotonic()
            if plan.open_loop:
                level_samples = await run_rate(session, plan, float(step), send_id=send_id, on_done=on_done,
                                               server=server)
            else:
                level_samples = await run_level(session, plan, int(step), send_id=send_id, on_done=on_done,
                                                server=server)
            await join_records(session, plan, level_samples)
            if plan.open_loop:  # its level: the concurrency it met (the proxy's record, when joined)
                for sample in level_samples:
                    sample.level = met_level(sample)
            on_level_done(int(step), len(level_samples), time.monotonic() - t0)
            run.samples.extend(level_samples)
        if plan.open_loop:
            run.samples.sort(key=lambda s: (s.level, s.client.rate or 0.0, s.index))
            for index, sample in enumerate(run.samples):
                sample.index = index
        return run
