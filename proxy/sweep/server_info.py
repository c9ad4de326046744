"""What the server says about its context: so a cut at a fixed length can be named, not just counted.

Each server has its own place for it, read here through the target (a transparent proxy passes
them on):
- llama.cpp's `GET /props`: `default_generation_settings.n_ctx` (the context one slot gets) and
  `total_slots` (tools/server/server-context.cpp, get_res_props);
- vLLM's `GET /v1/models`: `max_model_len` of the served model;
- Ollama's `GET /api/ps`: `context_length` of the loaded model (newer versions only).
Any of them may be absent; then the verdict says what the records show and no more.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import orjson

READ_TIMEOUT_S = 5.0
MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """The context the server says one request gets, and how many slots share it, where it says."""

    source: str  # e.g. "llama.cpp GET /props"
    context_per_request: int | None
    slots: int | None = None

    def describe(self) -> str:
        """`1,024 tokens per request over 4 slots (llama.cpp GET /props)`."""
        parts = []
        if self.context_per_request is not None:
            parts.append(f"{self.context_per_request:,} tokens per request")
        if self.slots is not None:
            parts.append(f"{self.slots} slot{'s' if self.slots != 1 else ''}")
        return f"{', '.join(parts) or 'nothing about its context'} ({self.source})"

    def split_hint(self) -> str | None:
        """With several slots: what one context split between them would be (the server does not say)."""
        if self.context_per_request is None or not self.slots or self.slots < 2:
            return None
        whole = self.context_per_request * self.slots
        return f"{whole:,} split over {self.slots} slots = {self.context_per_request:,} each?"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def from_llamacpp_props(body: Any) -> ServerInfo | None:
    if not isinstance(body, dict) or "total_slots" not in body:
        return None
    settings = body.get("default_generation_settings")
    n_ctx = _int(settings.get("n_ctx")) if isinstance(settings, dict) else None
    return ServerInfo("llama.cpp GET /props", n_ctx, _int(body.get("total_slots")))


def from_vllm_models(body: Any, model: str) -> ServerInfo | None:
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    lengths = {m.get("id"): _int(m.get("max_model_len")) for m in data if isinstance(m, dict)}
    length = lengths.get(model) or next((v for v in lengths.values() if v), None)
    return ServerInfo("vLLM GET /v1/models", length) if length else None


def from_ollama_ps(body: Any, model: str) -> ServerInfo | None:
    models = body.get("models") if isinstance(body, dict) else None
    if not isinstance(models, list):
        return None
    named = [m for m in models if isinstance(m, dict) and model in (m.get("name"), m.get("model"))]
    for entry in named or [m for m in models if isinstance(m, dict)]:
        length = _int(entry.get("context_length"))
        if length:
            return ServerInfo("Ollama GET /api/ps", length)
    return None


async def _get_json(session: aiohttp.ClientSession, url: str) -> Any:
    try:
        async with asyncio.timeout(READ_TIMEOUT_S), session.get(url) as response:
            if response.status != 200:
                return None
            body = await response.content.read(MAX_BODY_BYTES)
        return orjson.loads(body)
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, ValueError):
        return None


async def read_server_info(session: aiohttp.ClientSession, target: str, model: str) -> ServerInfo | None:
    """Ask the server about its context, llama.cpp's way, then vLLM's, then Ollama's; None if none says."""
    found = from_llamacpp_props(await _get_json(session, target + "/props"))
    if found is None:
        found = from_vllm_models(await _get_json(session, target + "/v1/models"), model)
    if found is None:
        found = from_ollama_ps(await _get_json(session, target + "/api/ps"), model)
    return found
