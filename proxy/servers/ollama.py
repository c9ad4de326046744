"""Ollama (`ollama serve`): loads models on demand, and cuts an over-long conversation silently.

- Recognized by `GET /api/version` (`{"version": ...}`); `GET /api/ps` says each loaded model's
  `context_length` (newer versions only). A model it has not loaded yet has no context to read: a
  request naming one is worth asking about again.
- When a conversation passes its context it drops earlier messages (or the head of one long prompt),
  answers 200, and reports the prompt count after the cut: a count below the words of the user's own
  turns proves the cut. It has no tokenizer to ask.
- Ollama 0.30.0 counted only the prompt tokens it processed, not those it had cached
  (llm/llama_server.go; fixed in 0.30.1, ollama#16414): that version's count is no bound on the prompt.
- Its native routes (`/api/chat`, `/api/generate`: the `ollama` dialect) name it before it answers.
- Its state is its list of loaded models (`/api/ps`), not a Prometheus page.
"""

from __future__ import annotations

from typing import Any

from proxy.record import RequestInfo, ResponseRecord
from proxy.servers.base import (
    PromptFinding,
    Server,
    ServerAnswers,
    ServerIdentity,
    ServerInfo,
    cut_below_words,
    positive_count,
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


class Ollama(Server):
    kind = "ollama"
    name = "Ollama"
    native_dialects = ("ollama",)
    telemetry_read = "loaded_models"

    async def identify(self, answers: ServerAnswers, models: tuple[str, ...]) -> ServerIdentity | None:
        version = await answers.get_json("/api/version")
        if not isinstance(version, dict) or not isinstance(version.get("version"), str):
            return None
        return ServerIdentity("ollama", None, loaded_contexts(await answers.get_json("/api/ps")),
                              version=version["version"][:40])

    async def context_for(self, answers: ServerAnswers, model: str) -> ServerInfo | None:
        found = loaded_contexts(await answers.get_json("/api/ps"))
        return found.get(model) or next(iter(found.values()), None)

    def asks_about(self, model: str, identity: ServerIdentity) -> bool:
        return model not in identity.by_model  # (loaded since, its context can be read)

    def prompt_truncation(self, record: ResponseRecord, info: RequestInfo, identity: ServerIdentity) -> PromptFinding:
        if (identity.version or "").startswith("0.30.0"):
            return PromptFinding(None, "Ollama 0.30.0 leaves cached tokens out of prompt_eval_count, so its count "
                                       "cannot show a cut")
        proven, seen = cut_below_words(record, info, identity)
        if proven is not None:
            return proven
        return PromptFinding(None, "Ollama cuts an over-long conversation silently, reports its prompt count after "
                                   f"the cut, and has no tokenizer to ask{seen}")


SERVER = Ollama()
