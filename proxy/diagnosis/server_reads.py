"""What the proxy asks the server about itself: which server it is, and the context each model
gets (the answers are read by proxy.wire.server_facts). Each read is bounded in time and size,
and any failure is an answer of nothing, never an error."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson

from proxy.servers.answers import AnswerTooLarge, read_whole
from proxy.wire.server_facts import (
    UNKNOWN_SERVER,
    ServerFacts,
    ServerInfo,
    from_llamacpp_props,
    from_ollama_ps,
    from_vllm_models,
    is_llamacpp_router,
    models_owner,
    ollama_contexts,
    router_loaded_models,
    vllm_contexts,
)

READ_TIMEOUT_S = 5.0
MAX_BODY_BYTES = 4 * 1024 * 1024
ROUTER_MODELS_MAX = 16  # a llama.cpp router's models asked about, at most


async def _get_json(session: aiohttp.ClientSession, url: str) -> Any:
    """The JSON of a whole answer (however many reads it comes in), or None: any other status, an
    answer over MAX_BODY_BYTES, not JSON, or no whole answer within READ_TIMEOUT_S."""
    try:
        async with asyncio.timeout(READ_TIMEOUT_S), session.get(url, allow_redirects=False) as response:
            if response.status != 200:
                return None
            body = await read_whole(response, MAX_BODY_BYTES)
        return orjson.loads(body)
    except (aiohttp.ClientError, TimeoutError, AnswerTooLarge, orjson.JSONDecodeError, ValueError):
        return None


def _model_query(model: str) -> str:
    return f"?model={quote(model, safe='')}&autoload=false"


async def read_server_info(session: aiohttp.ClientSession, target: str, model: str) -> ServerInfo | None:
    """Ask the server about `model`'s context, llama.cpp's way (its router's too), then vLLM's, then
    Ollama's; None if none says."""
    props = await _get_json(session, target + "/props")
    if is_llamacpp_router(props):
        props = await _get_json(session, target + "/props" + _model_query(model))
    found = from_llamacpp_props(props)
    if found is None:
        found = from_vllm_models(await _get_json(session, target + "/v1/models"), model)
    if found is None:
        found = from_ollama_ps(await _get_json(session, target + "/api/ps"), model)
    return found


async def read_server_facts(session: aiohttp.ClientSession, base: str,
                            models: tuple[str, ...] = ()) -> ServerFacts:
    """Which server `base` is and each model's context: llama.cpp by `/props` (in router mode, each of
    `models` by `?model=`), vLLM and SGLang by `/v1/models` and whom it says owns them, Ollama by
    `/api/version` (and `/api/ps` for its loaded models). UNKNOWN_SERVER when none answers so."""
    props = await _get_json(session, base + "/props")
    if is_llamacpp_router(props):
        names = dict.fromkeys([*router_loaded_models(await _get_json(session, base + "/v1/models")), *models])
        by_model = {}
        for model in list(names)[:ROUTER_MODELS_MAX]:
            info = from_llamacpp_props(await _get_json(session, base + "/props" + _model_query(model)))
            if info is not None:
                by_model[model] = info
        return ServerFacts("llamacpp", None, by_model, router=True)
    info = from_llamacpp_props(props)
    if info is not None:
        return ServerFacts("llamacpp", info)
    listing = await _get_json(session, base + "/v1/models")
    owner = models_owner(listing)
    if owner == "vllm":
        return ServerFacts("vllm", None, vllm_contexts(listing))
    if owner == "sglang":
        return ServerFacts("sglang", None, vllm_contexts(listing, "SGLang GET /v1/models"))
    version = await _get_json(session, base + "/api/version")
    if isinstance(version, dict) and isinstance(version.get("version"), str):
        return ServerFacts("ollama", None, ollama_contexts(await _get_json(session, base + "/api/ps")),
                           version=version["version"][:40])
    return UNKNOWN_SERVER
