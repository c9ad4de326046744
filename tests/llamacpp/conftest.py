"""Real llama.cpp servers for the end-to-end tests: the built `llama-server` and the tiny local model.

Every test here is marked `llamacpp` and skips, saying how to build it, when the binary is absent.
The servers are session-scoped (one start each); proxies are per test and cheap.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.llamacpp.llama_server import BINARY, LlamaServer, binary_available
from tests.llamacpp.make_tiny_gguf import write_tiny_gguf

SKIP_REASON = (
    f"llama-server not built at {BINARY}: run `bash tools/build_llama_server.sh` "
    "(about 25 minutes on 2 cores) or set LLAMA_SERVER_BIN"
)
# Slot geometry the tests rely on. With an explicit --parallel, this llama.cpp splits the KV
# cache: each slot gets ctx_size / parallel tokens (non-unified KV, see server-context.cpp).
SPLIT_CTX, SPLIT_PARALLEL = 1024, 4  # 256 tokens per slot
SLOT_CTX = SPLIT_CTX // SPLIT_PARALLEL


SERVER_FIXTURES = frozenset({"tiny_model", "split_server", "single_server", "unified_server", "long_server"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test in this folder `llamacpp`; skip those needing a server when there is no binary.

    Tests that replay the captured fixtures need no server and always run.
    """
    here = Path(__file__).parent
    missing = not binary_available()
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.llamacpp)
            if missing and SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random llama GGUF, written once per session."""
    return write_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf")


def _server(
    tmp_path_factory: pytest.TempPathFactory, model: Path, name: str, ctx: int, parallel: int, *extra: str
) -> Iterator[LlamaServer]:
    server = LlamaServer(model, ctx, parallel, tuple(extra))
    server.start(tmp_path_factory.mktemp("llama-server") / f"{name}.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def split_server(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[LlamaServer]:
    """4 slots sharing a 1024-token context: each slot holds 256 tokens."""
    yield from _server(tmp_path_factory, tiny_model, "split", SPLIT_CTX, SPLIT_PARALLEL)


@pytest.fixture(scope="session")
def single_server(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[LlamaServer]:
    """The same 1024-token context in one slot: the baseline a request has alone."""
    yield from _server(tmp_path_factory, tiny_model, "single", SPLIT_CTX, 1)


@pytest.fixture(scope="session")
def unified_server(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[LlamaServer]:
    """4 slots drawing on one unified 1024-token KV pool: only concurrency can exhaust it."""
    yield from _server(tmp_path_factory, tiny_model, "unified", SPLIT_CTX, SPLIT_PARALLEL, "--kv-unified")


@pytest.fixture
async def proxy_for() -> AsyncIterator[object]:
    """A factory: `await proxy_for(upstream_url)` starts a proxy on ephemeral ports, closed after the test."""
    from proxy.app import start_proxy
    from proxy.config import HostPort, ProxyConfig

    started: list[object] = []

    async def start(upstream: str) -> object:
        running = await start_proxy(
            ProxyConfig(
                upstream=upstream,
                listen=HostPort("127.0.0.1", 0),
                admin_listen=HostPort("127.0.0.1", 0),
                upstream_metrics="off",
            )
        )
        started.append(running)
        return running

    yield start
    for running in reversed(started):
        await running.close()  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def long_server(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[LlamaServer]:
    """One slot with the model's whole 32768-token context: a stream long enough to walk away from."""
    yield from _server(tmp_path_factory, tiny_model, "long", 32768, 1)
