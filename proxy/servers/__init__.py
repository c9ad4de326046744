"""What each inference server is: one module per server kind, registered here once, as the dialects are.

Owns: each server kind (`vllm`, `llamacpp`, `ollama`, `sglang`): how it is recognized, the context a
request gets, its tokenizer call, its prompt and budget rules, its metric names (`base.Server`); the
proxy's own questions to a server and their answers, read whole (`answers`); and who the upstream is,
kept fresh (`identity`). Nothing outside this folder branches on a server's kind: it asks the
registry (`server_of`) and calls the module.

Must not import: relay, diagnosis, observers, serve, sweep, simulator.
"""

from __future__ import annotations

from proxy.servers import llamacpp, ollama, sglang, vllm
from proxy.servers.base import Server

# In the order a server is recognized: llama.cpp's /props first (the others answer it 404), then whom
# /v1/models names, then Ollama's /api/version.
SERVERS: tuple[Server, ...] = (llamacpp.SERVER, vllm.SERVER, sglang.SERVER, ollama.SERVER)
UNKNOWN = Server()
_BY_KIND: dict[str, Server] = {server.kind: server for server in SERVERS}
_BY_DIALECT: dict[str, Server] = {dialect: server for server in SERVERS for dialect in server.native_dialects}
KINDS: frozenset[str] = frozenset(_BY_KIND)


def server_of(kind: str) -> Server:
    """The module of a server kind (`UNKNOWN` for one not known)."""
    return _BY_KIND.get(kind, UNKNOWN)


def server_described(source: str | None) -> Server:
    """The server a `ServerInfo.source` names (`vLLM GET /v1/models`), `UNKNOWN` for none."""
    return next((s for s in SERVERS if source is not None and source.startswith(s.name + " ")), UNKNOWN)


def server_of_dialect(dialect: str | None) -> Server | None:
    """The server a native route names (llama.cpp's `/completion`, Ollama's `/api/*`), else None."""
    return _BY_DIALECT.get(dialect or "")
