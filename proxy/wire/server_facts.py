"""What the server says about itself: which server it is, and the context one request gets.

Each server has its own place for it, read through its HTTP API (a transparent proxy passes them on):
- llama.cpp's `GET /props`: `default_generation_settings.n_ctx` (the context one slot gets) and
  `total_slots` (tools/server/server-context.cpp, get_res_props). In router mode (`--models-dir`)
  the bare `/props` says `role: router` with an `n_ctx` of 0, and each model's own answer is behind
  `?model=NAME` (tools/server/server-models.cpp, get_router_props); `autoload=false` keeps a state
  read from loading a model that is not running;
- vLLM's and SGLang's `GET /v1/models`: `max_model_len` of each served model, `owned_by` naming the
  server (`vllm`, `sglang`);
- Ollama's `GET /api/ps`: `context_length` of each loaded model (newer versions only); its
  `GET /api/version` answers `{"version": ...}`.
Any of them may be absent; then a diagnosis says what the records show and no more. This module
reads their answers (pure); proxy.diagnosis.server_reads asks for them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from proxy.wire.dialects.base import as_count

ServerKind = Literal["llamacpp", "vllm", "sglang", "ollama", "unknown"]
_KIND_OF_SOURCE: dict[str, ServerKind] = {"llama.cpp": "llamacpp", "vLLM": "vllm", "SGLang": "sglang",
                                          "Ollama": "ollama"}


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """The context the server says one request gets, and how many slots share it, where it says."""

    source: str  # e.g. "llama.cpp GET /props"
    context_per_request: int | None
    slots: int | None = None

    @property
    def kind(self) -> ServerKind:
        """Which server said it (from the source's first word)."""
        return _KIND_OF_SOURCE.get(self.source.partition(" ")[0], "unknown")

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


@dataclass(frozen=True, slots=True)
class ServerFacts:
    """Which server answers, and what it says of each model's context: what the proxy knows of its
    upstream between responses (refreshed by `ServerFactsProbe`)."""

    kind: ServerKind
    default: ServerInfo | None = None  # the context when a request names no model the server lists
    by_model: Mapping[str, ServerInfo] = field(default_factory=dict)
    router: bool = False  # llama.cpp's router mode: every state read needs ?model=
    version: str | None = None  # where the server says it (Ollama's /api/version)

    def info_for(self, model: str | None) -> ServerInfo | None:
        """What the server says of `model`'s context (its only model's, when it names one)."""
        if model is not None and model in self.by_model:
            return self.by_model[model]
        if self.default is not None:
            return self.default
        if len(self.by_model) == 1 and not self.router:
            return next(iter(self.by_model.values()))
        return None


    def to_dict(self) -> dict[str, Any]:
        """As the admin API's `/api/about` says it (`facts_from_dict` reads it back)."""
        return {"kind": self.kind, "router": self.router, "version": self.version,
                "default": self.default.to_dict() if self.default is not None else None,
                "models": {name: info.to_dict() for name, info in self.by_model.items()}}


UNKNOWN_SERVER = ServerFacts("unknown")
_KINDS = frozenset(("llamacpp", "vllm", "sglang", "ollama"))


def _info_from(value: Any) -> ServerInfo | None:
    if not isinstance(value, dict) or not isinstance(value.get("source"), str):
        return None
    return ServerInfo(value["source"][:80], _int(value.get("context_per_request")), _int(value.get("slots")))


def facts_from_dict(value: Any) -> ServerFacts:
    """`ServerFacts.to_dict()` read back (a proxy's `/api/about`); what is not of its shape is left out."""
    if not isinstance(value, dict) or value.get("kind") not in _KINDS:
        return UNKNOWN_SERVER
    models = value.get("models")
    by_model = {name[:200]: info for name, entry in (models.items() if isinstance(models, dict) else ())
                if isinstance(name, str) and (info := _info_from(entry)) is not None}
    version = value.get("version")
    return ServerFacts(value["kind"], _info_from(value.get("default")), by_model, router=value.get("router") is True,
                       version=version[:40] if isinstance(version, str) else None)


def _int(value: Any) -> int | None:
    """A context or a number of slots: a positive count; a negative or absurd one is not said."""
    number = as_count(value)
    return number if number is not None and number > 0 else None


def from_llamacpp_props(body: Any) -> ServerInfo | None:
    if not isinstance(body, dict) or "total_slots" not in body:
        return None
    settings = body.get("default_generation_settings")
    n_ctx = _int(settings.get("n_ctx")) if isinstance(settings, dict) else None
    return ServerInfo("llama.cpp GET /props", n_ctx, _int(body.get("total_slots")))


def is_llamacpp_router(body: Any) -> bool:
    """The bare `/props` of llama-server in router mode."""
    return isinstance(body, dict) and body.get("role") == "router"


def router_loaded_models(body: Any) -> list[str]:
    """The models a llama.cpp router runs now (its `/v1/models` with each one's `status.value`)."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return []
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)
            and isinstance(m.get("status"), dict) and m["status"].get("value") == "loaded"]


def models_owner(body: Any) -> str | None:
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    owners = {m.get("owned_by") for m in data if isinstance(m, dict)}
    return next((o for o in owners if isinstance(o, str)), None)


def vllm_contexts(body: Any, source: str = "vLLM GET /v1/models") -> dict[str, ServerInfo]:
    """Each served model's `max_model_len`, by id."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return {}
    found = {}
    for entry in data:
        if isinstance(entry, dict) and isinstance(entry.get("id"), str) and _int(entry.get("max_model_len")):
            found[entry["id"]] = ServerInfo(source, entry["max_model_len"])
    return found


def from_vllm_models(body: Any, model: str) -> ServerInfo | None:
    lengths = vllm_contexts(body)
    found = lengths.get(model) or next(iter(lengths.values()), None)
    return ServerInfo("vLLM GET /v1/models", found.context_per_request) if found else None


def ollama_contexts(body: Any) -> dict[str, ServerInfo]:
    """Each loaded model's `context_length`, by name (and by its `model` name, when they differ)."""
    models = body.get("models") if isinstance(body, dict) else None
    if not isinstance(models, list):
        return {}
    found = {}
    for entry in models:
        if not isinstance(entry, dict) or not _int(entry.get("context_length")):
            continue
        for name in (entry.get("name"), entry.get("model")):
            if isinstance(name, str):
                found[name] = ServerInfo("Ollama GET /api/ps", entry["context_length"])
    return found


def from_ollama_ps(body: Any, model: str) -> ServerInfo | None:
    found = ollama_contexts(body)
    return found.get(model) or next(iter(found.values()), None)


def contexts_text(facts: ServerFacts) -> dict[str, int | None]:
    """Each model's context, for a log line."""
    shown = {name: info.context_per_request for name, info in facts.by_model.items()}
    if facts.default is not None:
        shown["*"] = facts.default.context_per_request
    return shown
