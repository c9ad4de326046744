"""LM Studio (`lms server start`): loads models just in time and evicts them (JIT auto-evict), and
answers a prompt over its context with an empty 200 stream.

- Its own REST API lists every model it has with its `state` (`loaded`, `not-loaded`):
  `GET /api/v0/models` (LM Studio 0.3.6 and newer; docs: developer/rest/endpoints). That list is
  its state for the telemetry: which models run now. It serves no Prometheus page and no `/api/ps`.
- Its OpenAI-compatible routes are read by the `openai` dialect; its overflow and error wordings
  by the classifier (lmstudio-bug-tracker#546, #2322, #2339).

It is not a server kind of its own yet: nothing it says decides a prompt cut or a budget rule.
"""

from __future__ import annotations

from typing import Any

KIND = "lmstudio"
MODELS_PATH = "/api/v0/models"


def loaded_models(listing: Any) -> tuple[str, ...]:
    """The models LM Studio runs now, from its `/api/v0/models`; raises ValueError on another shape."""
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
        raise ValueError("no 'data' list of models")
    if not any("state" in m for m in data) and data:
        raise ValueError("no model has a 'state'")
    return tuple(m["id"] for m in data if isinstance(m.get("id"), str) and m.get("state") == "loaded")
