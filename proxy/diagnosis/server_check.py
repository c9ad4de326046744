"""After a response ends: what only the server can still say, asked off the relay path.

The proxy asks its upstream two things itself, on a connection of its own (never through the proxy
port, so its calls are never client traffic in the records, the metrics or the history):
- which server it is and the context a request gets (`ServerFactsProbe`: llama.cpp's `/props`,
  vLLM's and SGLang's `/v1/models`, Ollama's `/api/version` and `/api/ps`), refreshed every
  FACTS_REFRESH_S; every record's prompt verdict reads it;
- for a length stop whose tokens were only counted (an OpenAI stream without usage), the prompt's
  exact count by the server's own tokenizer and chat template (`ServerTokenizer`): vLLM's
  `POST /tokenize` with the request's messages, llama.cpp's `POST /v1/chat/completions/input_tokens`
  or `POST /tokenize`. The server's own budget rule then decides the cause (proxy.diagnosis.prompt_rules).

A record that waits for the tokenizer reaches the observers once, with its final cause
(`ServerCheck`, through a bounded `TokenizerQueue`: its bounds, its gate on the calls and its
breaker are there). Every answer is read whole, or to a cap. No client byte ever waits for any of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any

import aiohttp
import orjson
import structlog

from proxy.diagnosis.prompt_rules import PromptCount
from proxy.diagnosis.recorder import Recorder, TokenizerQuery
from proxy.diagnosis.server_reads import READ_TIMEOUT_S, read_server_facts
from proxy.diagnosis.tokenizer_queue import (
    DEFAULT_LIMITS,
    TIMEOUT_S,
    CallGate,
    CountsPrompts,
    QueueLimits,
    TokenizerQueue,
    TokenizerUnavailable,
)
from proxy.record import ResponseRecord
from proxy.servers.answers import AnswerTooLarge, read_whole
from proxy.wire.dialects.base import as_count
from proxy.wire.parsers import load_json
from proxy.wire.server_facts import UNKNOWN_SERVER, ServerFacts, contexts_text

_log = structlog.get_logger("llm_diag_proxy.server")

FACTS_REFRESH_S = 60.0
FACTS_RETRY_S = 5.0  # while the server is not known yet, or the last probe failed
MAX_MODELS_ASKED = 64  # models a llama.cpp router is asked about, at most
MAX_ANSWER_BYTES = 16 * 1024 * 1024  # a tokenizer answers with every token id: a prompt's worth
# Fields of a chat request that vLLM's chat template sees but /tokenize takes only as template kwargs
# (vllm/entrypoints/openai/chat_completion/protocol.py, build_chat_params).
_VLLM_TEMPLATE_KWARGS = ("documents", "reasoning_effort")
_VLLM_CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                     "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs", "media_io_kwargs")


class ServerFactsProbe:
    """What the upstream says of itself, kept fresh in the background; `facts` never waits."""

    def __init__(self, session: aiohttp.ClientSession, base: str, *, enabled: bool = True,
                 on_models: Callable[[Iterable[str]], None] = lambda names: None) -> None:
        self._session = session
        self._base = base.rstrip("/")
        self.enabled = enabled  # False: the server is never asked, and stays unknown
        self._on_models = on_models  # the models the server lists, each time it is asked
        self.facts: ServerFacts = UNKNOWN_SERVER
        self._models: dict[str, None] = {}  # models seen in requests (a router is asked about these)
        self._wake = asyncio.Event()
        self._logged: ServerFacts | None = None
        self.asked = asyncio.Event()  # set once the first probe has an answer (or failed)

    def saw_model(self, model: str | None) -> None:
        """A request named `model`: a llama.cpp router, or an Ollama that has not loaded it yet, is
        asked about it at the next probe, which comes at once for a model not known yet."""
        if model is None or model in self._models or len(self._models) >= MAX_MODELS_ASKED:
            return
        self._models[model] = None
        if self.facts.router or (self.facts.kind == "ollama" and model not in self.facts.by_model):
            self._wake.set()

    async def probe(self) -> ServerFacts:
        """Ask once; keep what was known when the server does not answer (a restart is the same server)."""
        found = await read_server_facts(self._session, self._base, tuple(self._models))
        if found.kind != "unknown" or self.facts.kind == "unknown":
            self.facts = found
        if found.by_model:
            self._on_models(found.by_model.keys())
        if self.facts != self._logged:
            self._logged = self.facts
            _log.info("upstream_identified", kind=self.facts.kind, router=self.facts.router,
                      contexts=contexts_text(self.facts))
        return found

    async def run(self) -> None:
        while True:
            try:
                found = await self.probe()
            except Exception as exc:  # a probe must never end the loop
                _log.debug("upstream_probe_failed", error=repr(exc)[:200])
                found = UNKNOWN_SERVER
            self.asked.set()
            wait = FACTS_REFRESH_S if found.kind != "unknown" else FACTS_RETRY_S
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)


class ServerTokenizer:
    """The upstream's own tokenizer, asked how many tokens a request's prompt has."""

    def __init__(self, session: aiohttp.ClientSession, base: str, authorization: str | None = None) -> None:
        self._session = session
        self._base = base.rstrip("/")
        self._authorization = authorization

    async def count(self, query: TokenizerQuery, facts: ServerFacts, client_authorization: str | None = None,
                    ) -> PromptCount:
        """The prompt's count and the context the server gives it; TokenizerUnavailable otherwise."""
        try:
            request = load_json(query.body)
        except ValueError:
            raise TokenizerUnavailable("the request body is not JSON", "unavailable") from None
        if not isinstance(request, dict):
            raise TokenizerUnavailable("the request body is not a JSON object", "unavailable")
        headers = {"Content-Type": "application/json"}
        credential = client_authorization or self._authorization
        if credential:
            headers["Authorization"] = credential
        if facts.kind == "vllm":
            return await self._vllm(query, request, facts, headers)
        if facts.kind == "llamacpp":
            return await self._llamacpp(query, request, facts, headers)
        raise TokenizerUnavailable(f"no tokenizer is known for this server ({facts.kind})", "unavailable")

    async def _post(self, path: str, payload: dict[str, Any] | bytes, headers: dict[str, str]) -> Any:
        """One tokenizer call. Counting has no side effect, so a pooled connection the server closed
        under it (uvicorn's keep-alive timer, say) is tried once more on another."""
        body = payload if isinstance(payload, bytes) else orjson.dumps(payload)
        for attempt in (1, 2):
            try:
                async with self._session.post(self._base + path, data=body, headers=headers,
                                              allow_redirects=False) as response:
                    status = response.status
                    answer = await read_whole(response, MAX_ANSWER_BYTES)  # however many reads it takes
                break
            except AnswerTooLarge:
                raise TokenizerUnavailable(f"POST {path}: answer over {MAX_ANSWER_BYTES} bytes") from None
            except TimeoutError:
                raise TokenizerUnavailable(f"POST {path} timed out", "timeout") from None
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if attempt == 2:
                    raise TokenizerUnavailable(f"POST {path}: {type(exc).__name__}") from None
            except aiohttp.ClientError as exc:
                raise TokenizerUnavailable(f"POST {path}: {type(exc).__name__}") from None
        if status == 404:
            raise TokenizerUnavailable(f"POST {path} answered 404", "unavailable")
        if status != 200:
            raise TokenizerUnavailable(f"POST {path} answered {status}")
        try:
            return load_json(answer)
        except ValueError:
            raise TokenizerUnavailable(f"POST {path}: the answer is not JSON") from None

    async def _vllm(self, query: TokenizerQuery, request: dict[str, Any], facts: ServerFacts,
                    headers: dict[str, str]) -> PromptCount:
        """vLLM's `POST /tokenize` renders `messages` with the same chat template as its chat route
        (vllm/entrypoints/serve/tokenize/protocol.py, TokenizeChatRequest) and answers `count` and
        `max_model_len`. What the chat route passes its template beyond those fields goes in as
        template kwargs; a tool choice or response format cannot, so such a count is approximate."""
        if "messages" in request:
            payload = {k: request[k] for k in _VLLM_CHAT_FIELDS if k in request}
            kwargs = dict(request.get("chat_template_kwargs") or {})
            for name in _VLLM_TEMPLATE_KWARGS:
                if request.get(name) is not None:
                    kwargs.setdefault(name, request[name])
            if request.get("reasoning_effort") is not None:
                kwargs.setdefault("enable_thinking", request["reasoning_effort"] != "none")
            if kwargs:
                payload["chat_template_kwargs"] = kwargs
            exact = "response_format" not in request and request.get("tool_choice") in (None, "auto", "none")
        else:
            prompt = request.get("prompt")
            if isinstance(prompt, list) and prompt and all(as_count(t) is not None for t in prompt):
                return PromptCount(len(prompt), _context(facts, query.model), "the request's own token ids")
            if not isinstance(prompt, str):
                raise TokenizerUnavailable("a batch of prompts is not counted", "unavailable")
            payload = {"prompt": prompt, "add_special_tokens": request.get("add_special_tokens", True)}
            exact = True
        if query.model is not None:
            payload["model"] = query.model
        answer = await self._post("/tokenize", payload, headers)
        count = as_count(answer.get("count")) if isinstance(answer, dict) else None
        context = as_count(answer.get("max_model_len")) if isinstance(answer, dict) else None
        if count is None:  # (a negative or absurd count is none)
            raise TokenizerUnavailable("POST /tokenize answered without a count")
        return PromptCount(count, (context if context else None) or _context(facts, query.model), "vLLM POST /tokenize",
                           exact)

    async def _llamacpp(self, query: TokenizerQuery, request: dict[str, Any], facts: ServerFacts,
                        headers: dict[str, str]) -> PromptCount:
        """llama-server counts a chat request whole, tools and template included, at
        `POST /v1/chat/completions/input_tokens` (server-context.cpp, handle_count_tokens); a
        `/completion` prompt at `POST /tokenize` with the special tokens it adds."""
        suffix = "?autoload=false" if facts.router else ""
        context = _context(facts, query.model)
        if query.route in ("/v1/chat/completions", "/chat/completions"):
            answer = await self._post(query.route + "/input_tokens" + suffix, query.body, headers)
            count = as_count(answer.get("input_tokens")) if isinstance(answer, dict) else None
            if count is None:
                raise TokenizerUnavailable(f"POST {query.route}/input_tokens answered without input_tokens")
            return PromptCount(count, context, f"llama.cpp POST {query.route}/input_tokens")
        prompt = request.get("prompt")
        if not isinstance(prompt, str):
            raise TokenizerUnavailable("only a text prompt is counted", "unavailable")
        payload: dict[str, Any] = {"content": prompt, "add_special": True, "parse_special": True}
        if query.model is not None:
            payload["model"] = query.model
        answer = await self._post("/tokenize" + suffix, payload, headers)
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list):
            raise TokenizerUnavailable("POST /tokenize answered without tokens")
        return PromptCount(len(tokens), context, "llama.cpp POST /tokenize")


async def settle_now(tokenizer: ServerTokenizer, record: ResponseRecord, query: TokenizerQuery, facts: ServerFacts,
                     timeout_s: float = TIMEOUT_S) -> None:
    """Ask the tokenizer for one record and wait (the sweep's own reading of a response)."""
    try:
        async with asyncio.timeout(timeout_s):
            count = await tokenizer.count(query, facts)
    except TimeoutError:
        Recorder.settle_length(record, query, facts.kind, None, f"not decided: no answer within {timeout_s:g} s")
    except TokenizerUnavailable as exc:
        Recorder.settle_length(record, query, facts.kind, None,
                               f"not decided: the server's tokenizer could not count the prompt: {exc}")
    else:
        Recorder.settle_length(record, query, facts.kind, count, None)


def _context(facts: ServerFacts, model: str | None) -> int | None:
    info = facts.info_for(model)
    return info.context_per_request if info is not None else None


class ServerCheck:
    """What the proxy asks its server after each response: who the server is (the probe, always
    fresh), and for the records that need it, the tokenizer (a bounded queue). Every other record
    passes straight through `deliver`."""

    def __init__(self, probe: ServerFactsProbe, tokenizer: CountsPrompts | None,
                 deliver: Callable[[ResponseRecord], None], limits: QueueLimits = DEFAULT_LIMITS,
                 on_result: Callable[[str], None] = lambda result: None,
                 clock: Callable[[], float] = time.monotonic, session: aiohttp.ClientSession | None = None,
                 on_lost: Callable[[], None] = lambda: None, gate: CallGate | None = None) -> None:
        self.probe = probe
        self._session = session  # closed with the check, when it owns one
        self._probing: asyncio.Task[None] | None = None
        self._deliver = deliver
        self._on_result = on_result
        self._closed = False
        self.queue = None if tokenizer is None else TokenizerQueue(
            tokenizer, lambda: self.probe.facts, deliver, limits, gate=gate,
            facts_known=probe.asked if probe.enabled else None, on_result=on_result, on_lost=on_lost, clock=clock)

    @property
    def facts(self) -> ServerFacts:
        return self.probe.facts

    def start(self) -> None:
        """Start probing the server and, when its tokenizer is asked, the queue's workers."""
        if self.probe.enabled:
            self._probing = asyncio.get_running_loop().create_task(self.probe.run(), name="server-facts")
        if self.queue is not None:
            self.queue.start()

    def finished(self, record: ResponseRecord, query: TokenizerQuery | None,
                 authorization: str | None = None) -> None:
        """A finished record: delivered now, or once the server's tokenizer has answered for it."""
        if query is None:
            self._deliver(record)
            return
        if self.queue is None:
            Recorder.settle_length(record, query, self.facts.kind, None,
                                   "not decided: the server's tokenizer is not asked (--server-tokenizer off)")
            self._on_result("skipped")
            self._deliver(record)
            return
        self.queue.put(record, query, authorization)

    async def close(self, timeout_s: float = 2.0) -> None:
        """Stop taking records; give those in flight `timeout_s`, then hand on every one left, undecided."""
        self._closed = True
        if self.queue is not None:
            await self.queue.close(timeout_s)
        if self._probing is not None:
            self._probing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probing
            self._probing = None
        if self._session is not None:
            await self._session.close()
            self._session = None


def open_server_check(upstream: str, authorization: str | None, deliver: Callable[[ResponseRecord], None], *,
                      identify: bool = True, tokenizer: bool = True, limits: QueueLimits = DEFAULT_LIMITS,
                      on_result: Callable[[str], None] = lambda result: None,
                      on_models: Callable[[Iterable[str]], None] = lambda names: None,
                      on_lost: Callable[[], None] = lambda: None, gate: CallGate | None = None) -> ServerCheck:
    """A check of `upstream` with a connection pool of its own (call inside the event loop, then `start`);
    without `probe` it never asks the server anything, and its facts stay unknown."""
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=max(limits.timeout_s, READ_TIMEOUT_S)),
                                    headers={"Authorization": authorization} if authorization else None)
    facts = ServerFactsProbe(session, upstream, enabled=identify, on_models=on_models)
    asker = ServerTokenizer(session, upstream) if tokenizer and identify else None
    return ServerCheck(facts, asker, deliver, limits, on_result, session=session, on_lost=on_lost, gate=gate)
