"""Who the upstream is, and the context each of its models gives a request: asked of the server, each
kind in turn (`proxy.servers.SERVERS`), and kept fresh in the background (`IdentityPoller`).

The proxy asks on a connection of its own, never through its own port, so its questions are never
client traffic in the records, the metrics or the history. Any of the answers may be absent; then a
diagnosis says what the records show and no more.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import aiohttp
import structlog

from proxy.servers import KINDS, SERVERS, server_of
from proxy.servers.answers import ServerAnswers
from proxy.servers.base import UNKNOWN_SERVER, Server, ServerIdentity, ServerInfo, contexts_text, info_from_dict

T = TypeVar("T")

_log = structlog.get_logger("llm_diag_proxy.server")

REFRESH_S = 60.0
RETRY_S = 5.0  # while the server is not known yet, or the last question went unanswered
MAX_MODELS_ASKED = 64  # models named in requests that the server is asked about, at most


async def read_identity(session: aiohttp.ClientSession, base: str, models: tuple[str, ...] = ()) -> ServerIdentity:
    """Which server `base` is and each model's context (a llama.cpp router is asked about each of
    `models`); UNKNOWN_SERVER when none answers as its kind does."""
    found = await _first(session, base, lambda server, answers: server.identify(answers, models))
    return found if found is not None else UNKNOWN_SERVER


async def read_context(session: aiohttp.ClientSession, base: str, model: str) -> ServerInfo | None:
    """The context `model` gets, in the first place a server says it (llama.cpp's `/props`, then any
    `/v1/models` that lists `max_model_len`, then Ollama's `/api/ps`); None if none says."""
    return await _first(session, base, lambda server, answers: server.context_for(answers, model))


async def _first(session: aiohttp.ClientSession, base: str,
                 ask: Callable[[Server, ServerAnswers], Awaitable[T | None]]) -> T | None:
    """The first server kind's answer that is not None, in the order kinds are recognized."""
    answers = ServerAnswers(session, base)
    for server in SERVERS:
        found = await ask(server, answers)
        if found is not None:
            return found
    return None


def identity_from_dict(value: Any) -> ServerIdentity:
    """`ServerIdentity.to_dict()` read back (a proxy's `/api/about`); what is not of its shape is left out."""
    if not isinstance(value, dict) or value.get("kind") not in KINDS:
        return UNKNOWN_SERVER
    models = value.get("models")
    by_model = {name[:200]: info for name, entry in (models.items() if isinstance(models, dict) else ())
                if isinstance(name, str) and (info := info_from_dict(entry)) is not None}
    version = value.get("version")
    return ServerIdentity(value["kind"], info_from_dict(value.get("default")), by_model,
                          router=value.get("router") is True,
                          version=version[:40] if isinstance(version, str) else None)


class IdentityPoller:
    """What the upstream says of itself, kept fresh in the background; `identity` never waits."""

    def __init__(self, session: aiohttp.ClientSession, base: str, *, enabled: bool = True,
                 on_models: Callable[[Iterable[str]], None] = lambda names: None) -> None:
        self._session = session
        self._base = base.rstrip("/")
        self.enabled = enabled  # False: the server is never asked, and stays unknown
        self._on_models = on_models  # the models the server lists, each time it is asked
        self.identity: ServerIdentity = UNKNOWN_SERVER
        self._models: dict[str, None] = {}  # models seen in requests (a router is asked about these)
        self._wake = asyncio.Event()
        self._logged: ServerIdentity | None = None
        self.asked = asyncio.Event()  # set once the first question has an answer (or none came)

    def saw_model(self, model: str | None) -> None:
        """A request named `model`: a server whose answer depends on it (a llama.cpp router, an
        Ollama that has not loaded it yet) is asked at once about a model not known yet."""
        if model is None or model in self._models or len(self._models) >= MAX_MODELS_ASKED:
            return
        self._models[model] = None
        if server_of(self.identity.kind).asks_about(model, self.identity):
            self._wake.set()

    async def ask(self) -> ServerIdentity:
        """Ask once; keep what was known when the server does not answer (a restart is the same server)."""
        found = await read_identity(self._session, self._base, tuple(self._models))
        if found.kind != "unknown" or self.identity.kind == "unknown":
            self.identity = found
        if found.by_model:
            self._on_models(found.by_model.keys())
        if self.identity != self._logged:
            self._logged = self.identity
            _log.info("upstream_identified", kind=self.identity.kind, router=self.identity.router,
                      contexts=contexts_text(self.identity))
        return found

    async def run(self) -> None:
        while True:
            try:
                found = await self.ask()
            except Exception as exc:  # a failed question must never end the loop
                _log.debug("upstream_identity_failed", error=repr(exc)[:200])
                found = UNKNOWN_SERVER
            self.asked.set()
            wait = REFRESH_S if found.kind != "unknown" else RETRY_S
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)
