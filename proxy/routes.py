"""Which request paths are generations, and in which dialect their responses come."""

from __future__ import annotations

from proxy.record import Dialect

OTHER_ROUTE = "other"

# Paths served by vLLM, Ollama (/v1 and native), llama.cpp's server, SGLang, LM Studio.
INFERENCE_ROUTES: dict[str, Dialect] = {
    "/v1/chat/completions": "openai",
    "/v1/completions": "openai",
    "/chat/completions": "openai",
    "/api/chat": "ollama",
    "/api/generate": "ollama",
    "/completion": "llamacpp",
    "/completions": "llamacpp",
}


def route_of(path: str) -> tuple[str, Dialect]:
    """The route label and dialect of a request path (`other`/`none` for non-generations)."""
    if len(path) > 1 and path.endswith("/"):
        path = path.rstrip("/")
    dialect = INFERENCE_ROUTES.get(path)
    if dialect is None:
        return OTHER_ROUTE, "none"
    return path, dialect
