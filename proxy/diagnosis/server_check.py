"""After a response ends: what only the server can still say, asked off the relay path.

The proxy asks its upstream two things itself, on a connection of its own (never through the proxy
port, so its calls are never client traffic in the records, the metrics or the history):
- which server it is and the context a request gets (`proxy.servers.identity.IdentityPoller`),
  kept fresh; every record's prompt verdict reads it;
- for a length stop whose tokens were only counted (an OpenAI stream without usage), the prompt's
  exact count by the server's own tokenizer and chat template (`ServerTokenizer`: the server's
  module says how, `proxy.servers`). The server's own budget rule then decides the cause
  (proxy.diagnosis.prompt_rules).

A record that waits for the tokenizer reaches the observers once, with its final cause
(`ServerCheck`, through a bounded `TokenizerQueue`: its bounds, its gate on the calls and its
breaker are there). Every answer is read whole, or to a cap. No client byte ever waits for any of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable

import aiohttp

from proxy.diagnosis.recorder import Recorder
from proxy.diagnosis.tokenizer_queue import (
    DEFAULT_LIMITS,
    TIMEOUT_S,
    CallGate,
    CountsPrompts,
    QueueLimits,
    TokenizerQueue,
)
from proxy.record import ResponseRecord
from proxy.servers import server_of
from proxy.servers.answers import READ_TIMEOUT_S, ServerAnswers
from proxy.servers.base import PromptCount, ServerIdentity, TokenizerQuery, TokenizerUnavailable
from proxy.servers.identity import IdentityPoller
from proxy.wire.parsers import load_json


class ServerTokenizer:
    """The upstream's own tokenizer, asked how many tokens a request's prompt has."""

    def __init__(self, session: aiohttp.ClientSession, base: str, authorization: str | None = None) -> None:
        self._session = session
        self._base = base.rstrip("/")
        self._authorization = authorization

    async def count(self, query: TokenizerQuery, identity: ServerIdentity, client_authorization: str | None = None,
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
        answers = ServerAnswers(self._session, self._base)
        return await server_of(identity.kind).count_prompt(answers, query, request, identity, headers)


async def settle_now(tokenizer: ServerTokenizer, record: ResponseRecord, query: TokenizerQuery,
                     identity: ServerIdentity, timeout_s: float = TIMEOUT_S) -> None:
    """Ask the tokenizer for one record and wait (the sweep's own reading of a response)."""
    try:
        async with asyncio.timeout(timeout_s):
            count = await tokenizer.count(query, identity)
    except TimeoutError:
        Recorder.settle_length(record, query, identity.kind, None, f"not decided: no answer within {timeout_s:g} s")
    except TokenizerUnavailable as exc:
        Recorder.settle_length(record, query, identity.kind, None,
                               f"not decided: the server's tokenizer could not count the prompt: {exc}")
    else:
        Recorder.settle_length(record, query, identity.kind, count, None)


class ServerCheck:
    """What the proxy asks its server after each response: who the server is (its identity, always
    fresh), and for the records that need it, the tokenizer (a bounded queue). Every other record
    passes straight through `deliver`."""

    def __init__(self, identity: IdentityPoller, tokenizer: CountsPrompts | None,
                 deliver: Callable[[ResponseRecord], None], limits: QueueLimits = DEFAULT_LIMITS,
                 on_result: Callable[[str], None] = lambda result: None,
                 clock: Callable[[], float] = time.monotonic, session: aiohttp.ClientSession | None = None,
                 on_lost: Callable[[], None] = lambda: None, gate: CallGate | None = None) -> None:
        self.identity_poller = identity
        self._session = session  # closed with the check, when it owns one
        self._polling: asyncio.Task[None] | None = None
        self._deliver = deliver
        self._on_result = on_result
        self._closed = False
        self.queue = None if tokenizer is None else TokenizerQueue(
            tokenizer, lambda: self.identity_poller.identity, deliver, limits, gate=gate,
            identity_known=identity.asked if identity.enabled else None, on_result=on_result, on_lost=on_lost,
            clock=clock)

    @property
    def identity(self) -> ServerIdentity:
        """What the server says of itself now."""
        return self.identity_poller.identity

    def saw_model(self, model: str | None) -> None:
        """A finished record named `model` (the server may be asked about it)."""
        self.identity_poller.saw_model(model)

    def start(self) -> None:
        """Start asking the server who it is and, when its tokenizer is asked, the queue's workers."""
        if self.identity_poller.enabled:
            self._polling = asyncio.get_running_loop().create_task(self.identity_poller.run(), name="server-identity")
        if self.queue is not None:
            self.queue.start()

    def finished(self, record: ResponseRecord, query: TokenizerQuery | None,
                 authorization: str | None = None) -> None:
        """A finished record: delivered now, or once the server's tokenizer has answered for it."""
        if query is None:
            self._deliver(record)
            return
        if self.queue is None:
            Recorder.settle_length(record, query, self.identity.kind, None,
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
        if self._polling is not None:
            self._polling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._polling
            self._polling = None
        if self._session is not None:
            await self._session.close()
            self._session = None


def open_server_check(upstream: str, authorization: str | None, deliver: Callable[[ResponseRecord], None], *,
                      identify: bool = True, tokenizer: bool = True, limits: QueueLimits = DEFAULT_LIMITS,
                      on_result: Callable[[str], None] = lambda result: None,
                      on_models: Callable[[Iterable[str]], None] = lambda names: None,
                      on_lost: Callable[[], None] = lambda: None, gate: CallGate | None = None) -> ServerCheck:
    """A check of `upstream` with a connection pool of its own (call inside the event loop, then
    `start`); without `identify` it never asks the server anything, and its identity stays unknown."""
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=max(limits.timeout_s, READ_TIMEOUT_S)),
                                    headers={"Authorization": authorization} if authorization else None)
    identity = IdentityPoller(session, upstream, enabled=identify, on_models=on_models)
    asker = ServerTokenizer(session, upstream) if tokenizer and identify else None
    return ServerCheck(identity, asker, deliver, limits, on_result, session=session, on_lost=on_lost, gate=gate)
