"""Ollama (`ollama serve`): loads models on demand, and cuts an over-long conversation silently.

- Recognized by `GET /api/version` (`{"version": ...}`); `GET /api/ps` says each loaded model's
  `context_length` (newer versions only). A model it has not loaded yet has no context to read: a
  request naming one is worth asking about again.
- When a conversation passes its context it drops the oldest messages but the system ones and the
  last (server/prompt.go, chatPrompt), answers 200, and reports the prompt count after the cut. It
  has no tokenizer to ask, so the cut is decided by bounds (`base.silent_cut`): every message's words
  are a lower bound on the prompt's tokens; its bytes, with the template and the model's own system
  prompt that `POST /api/show` gives (api/types.go, ShowResponse: `template`, `system`; a model with
  a built-in `renderer` shows none), an upper bound.
- The context a request gets: `options.num_ctx` on its own routes (`/api/*`); its OpenAI routes
  (`/v1/*`) ignore it and the model's loaded context (`/api/ps`) applies.
- Ollama 0.30.0 counted only the prompt tokens it processed, not those it had cached
  (llm/llama_server.go; fixed in 0.30.1, ollama#16414): that version's count is no bound on the prompt.
- Its native routes (`/api/chat`, `/api/generate`: the `ollama` dialect) name it before it answers.
- Its state is its list of loaded models (`/api/ps`), not a Prometheus page.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from proxy.record import RequestInfo, ResponseRecord
from proxy.servers.base import (
    PromptFinding,
    Server,
    ServerAnswers,
    ServerIdentity,
    ServerInfo,
    TokenizerUnavailable,
    positive_count,
    silent_cut,
)


def loaded_contexts(ps: Any) -> dict[str, ServerInfo]:
    """Each loaded model's `context_length`, by name (and by its `model` name, when they differ)."""
    models = ps.get("models") if isinstance(ps, dict) else None
    if not isinstance(models, list):
        return {}
    found = {}
    for entry in models:
        if not isinstance(entry, dict) or not positive_count(entry.get("context_length")):
            continue
        for name in (entry.get("name"), entry.get("model")):
            if isinstance(name, str):
                found[name] = ServerInfo("Ollama GET /api/ps", entry["context_length"])
    return found


SHOWN_MAX = 8  # loaded models whose template is asked for (`POST /api/show`), at most


def template_sizes(show: Any) -> tuple[int | None, int | None]:
    """(the template's bytes, the default system prompt's bytes) of a model's `/api/show` (api/types.go,
    ShowResponse); (None, None) where a built-in renderer, not a template, makes the prompt (its size
    is not in the answer), or where the answer says neither."""
    if not isinstance(show, dict) or show.get("renderer") or not isinstance(show.get("template"), str):
        return None, None
    system = show.get("system")
    return len(show["template"].encode()), len(system.encode()) if isinstance(system, str) else 0


class Ollama(Server):
    kind = "ollama"
    name = "Ollama"

    def concurrency_switch(self, limit: int) -> str | None:
        return f"OLLAMA_NUM_PARALLEL={limit}"
    native_dialects = ("ollama",)
    telemetry_read = "loaded_models"

    async def identify(self, answers: ServerAnswers, models: tuple[str, ...]) -> ServerIdentity | None:
        version = await answers.get_json("/api/version")
        if not isinstance(version, dict) or not isinstance(version.get("version"), str):
            return None
        contexts = loaded_contexts(await answers.get_json("/api/ps"))
        for name in list(contexts)[:SHOWN_MAX]:
            try:
                show = await answers.post_json("/api/show", {"model": name}, {"Content-Type": "application/json"})
            except TokenizerUnavailable:  # (an answer of nothing: the bound stays unknown)
                continue
            template, system = template_sizes(show)
            if template is not None:
                contexts[name] = replace(contexts[name], template_bytes=template, system_bytes=system)
        return ServerIdentity("ollama", None, contexts, version=version["version"][:40])

    async def context_for(self, answers: ServerAnswers, model: str) -> ServerInfo | None:
        found = loaded_contexts(await answers.get_json("/api/ps"))
        return found.get(model) or next(iter(found.values()), None)

    def asks_about(self, model: str, identity: ServerIdentity) -> bool:
        return model not in identity.by_model  # (loaded since, its context can be read)

    def prompt_truncation(self, record: ResponseRecord, info: RequestInfo, identity: ServerIdentity) -> PromptFinding:
        if (identity.version or "").startswith("0.30.0"):
            return PromptFinding(None, "Ollama 0.30.0 leaves cached tokens out of prompt_eval_count, so its count "
                                       "cannot show a cut")
        return silent_cut(record, info, identity, "Ollama", "Ollama cuts an over-long conversation silently, reports "
                          "its prompt count after the cut, and has no tokenizer to ask")

SERVER = Ollama()
