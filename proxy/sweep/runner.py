"""The sweep's load client: closed-loop streaming requests at each concurrency level.

At level L the sweep keeps exactly L requests in flight: L slots each send a request, and
each finished one is replaced at once, until L x repeats requests have been sent (so `repeats`
is the number of requests per slot). Only the last requests of a level run with fewer in
flight; the proxy's `concurrency_mean` in each record shows what every response really saw.
Every request is the same body: prompt, budget, seed, temperature; only concurrency changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp
import orjson

from proxy.diagnosis.recorder import Recorder
from proxy.diagnosis.server_check import ServerTokenizer, settle_now
from proxy.record import record_from_dict
from proxy.servers.base import UNKNOWN_SERVER, ServerIdentity, ServerInfo
from proxy.servers.identity import identity_from_dict, read_context, read_identity
from proxy.sweep.answer_text import AnswerText
from proxy.sweep.open_loop import arrivals
from proxy.sweep.sample import ClientMeasure, Sample

SweepDialect = Literal["openai", "ollama", "anthropic", "responses"]
SWEEP_DIALECTS: tuple[str, ...] = SweepDialect.__args__  # type: ignore[attr-defined]
PATHS: dict[str, str] = {"openai": "/v1/chat/completions", "ollama": "/api/chat", "anthropic": "/v1/messages",
                         "responses": "/v1/responses"}
ASK_TIMEOUT_S = 5.0
JOIN_WAIT_S = 2.0  # the proxy stores a record just after the last byte: allow it that long
JOIN_RETRY_S = 0.05
REQUEST_ID = "X-Request-Id"
PROXY_HEADER = "X-LLM-Diag-Concurrency"  # what every answer through llm-diag-proxy carries
# Words that are one token each (with the space before them) in the usual tokenizers (Llama, Qwen,
# Mistral, GPT's): a prompt of N of them is about N tokens, whatever the model.
PROMPT_WORDS = ("the", "of", "and", "to", "in", "is", "it", "that", "for", "on", "was", "with", "as", "at",
                "by", "from", "this", "be", "are", "or", "one", "all", "but", "not", "what", "when", "can",
                "there", "more", "about", "time", "people", "water", "world", "day", "house", "city", "year")
PROMPT_INSTRUCTION = "Write a long story that uses these words:"
PROMPT_OVERHEAD_TOKENS = 20  # the instruction and a chat template's own tokens, about
CALIBRATION_ROUNDS = 3  # requests at most that set a synthetic prompt's words by the server's counts


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
    prompt_tokens: int | None = None  # --prompt-tokens: a synthetic prompt of about this many tokens
    prompt_words: int | None = None  # the words of that prompt, once the server's counts have set them

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


def synthetic_prompt(words: int) -> str:
    """`--prompt-tokens`'s prompt: a short instruction and `words` common words, one token each in the
    usual tokenizers. It repeats the length of prompts the proxy recorded without their text, which the
    proxy never keeps; the sweep sets the number of words by the server's own counts (`calibrate`), and
    each record says what the server counted (prompt_tokens)."""
    return " ".join((PROMPT_INSTRUCTION, *(PROMPT_WORDS[n % len(PROMPT_WORDS)] for n in range(max(1, words)))))


def prompt_words(plan: SweepPlan) -> int:
    """The words of the synthetic prompt: as calibrated, else a first guess (a template's tokens allowed for)."""
    assert plan.prompt_tokens is not None
    return plan.prompt_words if plan.prompt_words is not None else max(1, plan.prompt_tokens - PROMPT_OVERHEAD_TOKENS)


def prompt_of(plan: SweepPlan) -> str:
    return plan.prompt if plan.prompt_tokens is None else synthetic_prompt(prompt_words(plan))


def request_body(plan: SweepPlan) -> bytes:
    """The one request body every response of the sweep answers, in the plan's dialect."""
    prompt = prompt_of(plan)
    messages = [{"role": "user", "content": prompt}]
    body: dict[str, Any]
    if plan.dialect == "ollama":
        body = {"model": plan.model, "messages": messages, "stream": True,
                "options": {"num_predict": plan.max_tokens, "seed": plan.seed,
                            "temperature": plan.temperature}}
    elif plan.dialect == "anthropic":  # the Messages API has no seed
        body = {"model": plan.model, "messages": messages, "max_tokens": plan.max_tokens,
                "temperature": plan.temperature, "stream": True}
    elif plan.dialect == "responses":
        body = {"model": plan.model, "input": prompt, "max_output_tokens": plan.max_tokens,
                "temperature": plan.temperature, "stream": True}
    else:
        body = {"model": plan.model, "messages": messages, "max_tokens": plan.max_tokens,
                "seed": plan.seed, "temperature": plan.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
    return orjson.dumps(body)


@dataclass(frozen=True, slots=True)
class ServerSide:
    """What the sweep knows of the server, and its tokenizer, to read a response as the proxy does."""

    identity: ServerIdentity = UNKNOWN_SERVER
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
    via_proxy = False
    error: str | None = None
    text = AnswerText(plan.dialect)
    try:
        async with asyncio.timeout(plan.timeout_s or None):
            headers = {"Content-Type": "application/json"}
            if send_id:
                headers[REQUEST_ID] = request_id
            async with session.post(plan.target + plan.path, data=body, headers=headers) as response:
                status = response.status
                via_proxy = PROXY_HEADER in response.headers
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
    record = recorder.finish(time.monotonic(), server=server.identity)
    measure = ClientMeasure(status=status, ttft_s=record.ttft_s, itl_mean_s=record.itl_mean_s,
                            itl_p95_s=record.itl_p95_s, chunks=recorder.tally.tokens,
                            duration_s=time.monotonic() - t0, in_flight_at_start=in_flight, error=error,
                            answer_hash=text.digest(), via_proxy=via_proxy)
    query = recorder.tokenizer_query()
    if query is not None and server.tokenizer is not None and plan.admin is None:
        await settle_now(server.tokenizer, record, query, server.identity)  # the proxy's record settles itself
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


async def listening(url: str, what: str) -> None:
    """Fail early with one line when nothing listens at a URL's host and port. A connection, and no
    request: an HTTP request through the proxy would be a record, a metric and, where the server
    answers 404, an upstream error, all of the sweep's own making."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        async with asyncio.timeout(ASK_TIMEOUT_S):
            _, writer = await asyncio.open_connection(parts.hostname, port)
    except (OSError, TimeoutError) as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
        raise SweepError(f"cannot reach the {what} at {url}: {reason}") from None
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def read_about(session: aiohttp.ClientSession, plan: SweepPlan) -> tuple[ServerIdentity, str | None]:
    """What the proxy behind `--admin` knows of its server (`GET /api/about`), and its upstream's URL:
    the server is never asked through the proxy. Unknown (and None) when the proxy cannot say (an
    older one, an error)."""
    assert plan.admin is not None
    headers = {"Authorization": f"Bearer {plan.admin_token}"} if plan.admin_token else {}
    try:
        async with asyncio.timeout(ASK_TIMEOUT_S), session.get(plan.admin + "/api/about",
                                                                 headers=headers) as response:
            if response.status != 200:
                return UNKNOWN_SERVER, None
            about = orjson.loads(await response.read())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return UNKNOWN_SERVER, None
    if not isinstance(about, dict):
        return UNKNOWN_SERVER, None
    proxy = about.get("proxy")
    upstream = proxy.get("upstream") if isinstance(proxy, dict) else None
    return identity_from_dict(about.get("server")), upstream if isinstance(upstream, str) else None


async def answers_at_all(session: aiohttp.ClientSession, url: str, what: str, headers: dict[str, str]) -> None:
    """Fail early with one line when a URL cannot be reached at all (any HTTP answer is fine)."""
    try:
        async with asyncio.timeout(ASK_TIMEOUT_S):
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
    plan: SweepPlan | None = None  # the plan as it ran (a synthetic prompt's length set after the warm-up)


@dataclass(frozen=True, slots=True)
class WarmedUp:
    """What the warm-up showed: whether requests may carry X-Request-Id, and whether the target is
    llm-diag-proxy (then the sweep asks the server nothing through it)."""

    send_id: bool = True
    via_proxy: bool = False
    prompt_tokens: int | None = None  # the server's count of the last warm-up's prompt, where it said


async def warm_up(session: aiohttp.ClientSession, plan: SweepPlan, body: bytes, notes: list[str]) -> WarmedUp:
    """The unrecorded first requests (recorded by a proxy in between like any request).

    A refused connection ends the sweep. A 4xx that is not about the context means the request
    itself is wrong (model, dialect): one line, with the server's own reason. A server that refuses
    only the X-Request-Id header is swept without it, joined by the id the proxy answers with. A
    request too large for the server's context is no mistake of the flags but a finding: the
    sweep goes on, and the verdict reports it.
    """
    send_id, via_proxy, counted = True, False, None
    for number in range(plan.warmup):
        warm = await send_one(session, plan, body, str(uuid.uuid4()), 0, number, 1, send_id=send_id)
        via_proxy = via_proxy or warm.client.via_proxy
        record = warm.record
        counted = record.prompt_tokens if record.prompt_tokens_source in ("usage", "server_error") else counted
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
    return WarmedUp(send_id, via_proxy, counted)


async def calibrate(session: aiohttp.ClientSession, plan: SweepPlan, counted: int | None, send_id: bool,
                    notes: list[str]) -> SweepPlan:
    """`--prompt-tokens N`: the synthetic prompt's words set so that the server counts N tokens, whatever
    its tokenizer and chat template (a word is one token in the usual tokenizers, several in a
    character-level one). `counted` is the server's count of the warm-up's prompt; each further round is
    one more request (recorded by a proxy in between like any), at most CALIBRATION_ROUNDS. A server
    that says no count (an OpenAI stream without usage, no refusal) leaves the first guess."""
    assert plan.prompt_tokens is not None
    target, words = plan.prompt_tokens, prompt_words(plan)
    seen: list[tuple[int, int]] = []  # (words, tokens counted)
    for round_ in range(CALIBRATION_ROUNDS + 1):
        if counted is None:
            notes.append(f"the server said no prompt count: the synthetic prompt is {words:,} words, about "
                         f"{target:,} tokens in the usual tokenizers")
            break
        seen.append((words, counted))
        if abs(counted - target) <= max(2, target // 50) or round_ == CALIBRATION_ROUNDS:
            notes.append(f"the synthetic prompt of {words:,} words is {counted:,} tokens by the server's count "
                         f"(asked: {target:,})")
            break
        if len(seen) >= 2 and seen[-1][0] != seen[-2][0] and seen[-1][1] != seen[-2][1]:
            (w0, t0), (w1, t1) = seen[-2], seen[-1]  # tokens are linear in words: the secant through both
            words = max(1, round(w1 + (target - t1) * (w1 - w0) / (t1 - t0)))
        else:
            words = max(1, round(words * target / max(counted, 1)))
        plan = replace(plan, prompt_words=words)
        trial = await send_one(session, plan, request_body(plan), str(uuid.uuid4()), 0, round_, 1, send_id=send_id)
        record = trial.record
        counted = record.prompt_tokens if record.prompt_tokens_source in ("usage", "server_error") else None
    return replace(plan, prompt_words=words)


async def server_side(session: aiohttp.ClientSession, plan: SweepPlan, warmed: WarmedUp,
                      notes: list[str]) -> tuple[ServerInfo | None, ServerSide]:
    """What the server says of its context, and its tokenizer when the sweep reads responses itself.
    Through a proxy the server is asked nothing: the proxy's `--admin` says what it knows (and its
    records are settled by its own tokenizer). A server swept directly is asked as the proxy asks it."""
    if plan.admin is not None:
        identity, upstream = await read_about(session, plan)
        if identity.kind == "unknown" and upstream is not None:
            # A proxy that asks its server nothing (--upstream-metrics off): the sweep asks the server
            # itself, at its own address, never through the proxy port.
            info = await read_context(session, upstream, plan.model)
            return info, ServerSide(await read_identity(session, upstream, (plan.model,)))
        return identity.info_for(plan.model), ServerSide(identity)
    if warmed.via_proxy:
        notes.append("the target is llm-diag-proxy: without --admin the sweep asks the server nothing through it, "
                     "so its context is not named and counted length stops stay open; pass --admin")
        return None, ServerSide()
    # After the warm-up: a llama.cpp router has loaded the model by then, and only a loaded model's
    # context can be read (a state read never loads one).
    info = await read_context(session, plan.target, plan.model)
    identity = await read_identity(session, plan.target, (plan.model,))
    return info, ServerSide(identity, ServerTokenizer(session, plan.target))


async def run_sweep(plan: SweepPlan, *, on_level_start: Callable[[int], None] = lambda level: None,
                    on_done: Callable[[], None] = lambda: None,
                    on_level_done: Callable[[int, int, float], None] = lambda level, n, s: None,
                    ) -> SweepRun:
    """Every level in order, after `warmup` unrecorded requests (a model load must not count)."""
    # Open loop: no bound in the client, or its queue would hold arrivals back (the load is the rates').
    connector = aiohttp.TCPConnector(limit=0 if plan.open_loop else max(plan.levels), force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=ASK_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await listening(plan.target, "target")
        if plan.admin is not None:
            await answers_at_all(session, plan.admin + "/healthz", "proxy's admin API", {})
        run = SweepRun([])
        warmed = await warm_up(session, plan, request_body(plan), run.notes)
        send_id = warmed.send_id
        if plan.prompt_tokens is not None:
            plan = await calibrate(session, plan, warmed.prompt_tokens, send_id, run.notes)
        run.plan = plan
        run.server, server = await server_side(session, plan, warmed, run.notes)
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
