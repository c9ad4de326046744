"""The wire dialects the proxy reads, and the one registry that maps request paths to them.

Adding a dialect: write one module here that ends with a `DIALECT` (see `base.Dialect`), add it
to REGISTRY, and test it. Nothing else in the proxy names a dialect.
"""

from __future__ import annotations

from proxy.wire.dialects import anthropic, llamacpp, ollama, openai, responses
from proxy.wire.dialects.base import Dialect

REGISTRY: tuple[Dialect, ...] = (
    openai.DIALECT,
    ollama.DIALECT,
    llamacpp.DIALECT,
    anthropic.DIALECT,
    responses.DIALECT,
)
# Error bodies of routes that are not generations are read as OpenAI-style `{"error": ...}`.
FALLBACK = openai.DIALECT
OTHER_ROUTE = "other"

_BY_ROUTE: dict[str, Dialect] = {route: d for d in REGISTRY for route in d.routes}
_BY_NAME: dict[str, Dialect] = {d.name: d for d in REGISTRY}
if len(_BY_ROUTE) != sum(len(d.routes) for d in REGISTRY):
    raise RuntimeError("two dialects claim the same route")

NAMES: tuple[str, ...] = tuple(_BY_NAME)


def route_of(path: str) -> tuple[str, Dialect | None]:
    """The route label and dialect of a request path (`other` and None for non-generations)."""
    if len(path) > 1 and path.endswith("/"):
        path = path.rstrip("/")
    dialect = _BY_ROUTE.get(path)
    return (OTHER_ROUTE, None) if dialect is None else (path, dialect)


def dialect_named(name: str) -> Dialect:
    """The dialect called `name` (KeyError for an unknown one)."""
    return _BY_NAME[name]


def provider_of(name: str) -> str:
    """The GenAI provider a dialect's requests go to (`gen_ai.provider.name`); the name itself for one not known."""
    dialect = _BY_NAME.get(name)
    return (dialect.provider or dialect.name) if dialect is not None else name


def sweep_dialect_of(name: str | None) -> str:
    """The dialect a sweep repeats requests of dialect `name` in (`openai` for one not known)."""
    dialect = _BY_NAME.get(name or "")
    return (dialect.sweep_dialect or dialect.name) if dialect is not None else "openai"
