"""Real llama.cpp servers for the end-to-end tests: the built `llama-server` and the tiny local model.

Every test here is marked `llamacpp` and skips, saying how to build it, when the binary is absent.
The servers are session-scoped (one start each); proxies are per test and cheap.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.real_servers.llamacpp import llama_cpp_python_server
from tests.real_servers.llamacpp.llama_cpp_python_server import LlamaCppPythonServer
from tests.real_servers.llamacpp.llama_server import BINARY, LlamaServer, binary_available

SKIP_REASON = (
    f"llama-server not built at {BINARY}: run `bash tools/build_llama_server.sh` "
    "(about 9 minutes on 2 cores) or set LLAMA_SERVER_BIN"
)
# Slot geometry the tests rely on. With an explicit --parallel, this llama.cpp splits the KV
# cache: each slot gets ctx_size / parallel tokens, rounded up to a multiple of 256 (non-unified
# KV, src/llama-context.cpp), so no slot is smaller than 256. With --kv-unified every slot may
# use all of it, and the slots share it.
SPLIT_CTX, SPLIT_PARALLEL = 1024, 4  # 256 tokens per slot
SLOT_CTX = SPLIT_CTX // SPLIT_PARALLEL
# The model that ends its chat answers with EOS after EOS_AFTER characters, asked with a prompt
# of EOS_PROMPT_TOKENS: an answer needs 227 + 41 = 268 tokens of context to complete.
EOS_AFTER = 40
EOS_PROMPT = ("Tell me about llamas. " * 8).strip()
EOS_PROMPT_TOKENS = 227  # BOS + the ChatML frame (51 characters) + 175 characters
EOS_SINGLE_CTX = 512  # one slot of 512: completes
EOS_SPLIT_CTX = 1024  # four slots of 256: each answer cut after 29 tokens, concurrent or not
EOS_UNIFIED_CTX = 512  # one pool for 4 slots, asked with the longer UNIFIED_PROMPT:
UNIFIED_PROMPT = ("Tell me about llamas. " * 16).strip()
UNIFIED_PROMPT_TOKENS = 403  # one answer (444) fits; a second prompt beside it (403 + 403) does not,
# so two requests that overlap at all both fail, however far apart they started
SERVER_FIXTURES = frozenset({
    "tiny_model", "eos_model", "split_server", "long_server", "eos_single_server", "eos_split_server",
    "eos_unified_server", "eos_shift_server",
})
PYTHON_SERVER_FIXTURES = frozenset({"python_server", "python_eos_server"})
PYTHON_SKIP_REASON = (
    f"llama-cpp-python's server not installed at {llama_cpp_python_server.PYTHON}: run "
    "`bash tools/build_llama_server.sh && bash tools/setup_llama_cpp_python.sh` (it loads that build's libllama)"
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test in this folder `llamacpp`; skip those needing a server when there is no binary.

    Tests that replay the captured fixtures need no server and always run.
    """
    here = Path(__file__).parent
    missing = not binary_available()
    python_missing = not llama_cpp_python_server.available()
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.llamacpp)
            fixtures = set(getattr(item, "fixturenames", ()))
            if missing and SERVER_FIXTURES & fixtures:
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))
            elif python_missing and PYTHON_SERVER_FIXTURES & fixtures:
                item.add_marker(pytest.mark.skip(reason=PYTHON_SKIP_REASON))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama GGUF that never samples EOS, written once per session."""
    from tests.real_servers.llamacpp.make_tiny_gguf import write_tiny_gguf  # numpy: only where a server runs

    return write_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf")


@pytest.fixture(scope="session")
def eos_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model, but every chat answer ends on its own (EOS) after EOS_AFTER characters."""
    from tests.real_servers.llamacpp.make_tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny-eos.gguf", eos_after=EOS_AFTER)


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
    """Never EOS; 4 slots sharing a 1024-token context: each slot holds 256 tokens."""
    yield from _server(tmp_path_factory, tiny_model, "split", SPLIT_CTX, SPLIT_PARALLEL)


@pytest.fixture(scope="session")
def long_server(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[LlamaServer]:
    """Never EOS; one slot with the model's whole 32768-token context: a stream to walk away from."""
    yield from _server(tmp_path_factory, tiny_model, "long", 32768, 1)


@pytest.fixture(scope="session")
def eos_single_server(tmp_path_factory: pytest.TempPathFactory, eos_model: Path) -> Iterator[LlamaServer]:
    """Answers end on their own; one slot of 512 tokens: room to complete."""
    yield from _server(tmp_path_factory, eos_model, "eos-single", EOS_SINGLE_CTX, 1)


@pytest.fixture(scope="session")
def eos_split_server(tmp_path_factory: pytest.TempPathFactory, eos_model: Path) -> Iterator[LlamaServer]:
    """Answers end on their own; 1024 split into 4 slots of 256: too small to complete."""
    yield from _server(tmp_path_factory, eos_model, "eos-split", EOS_SPLIT_CTX, 4)


@pytest.fixture(scope="session")
def eos_unified_server(tmp_path_factory: pytest.TempPathFactory, eos_model: Path) -> Iterator[LlamaServer]:
    """Answers end on their own; 4 slots drawing on one 512-token pool: one answer fits, two do not."""
    yield from _server(tmp_path_factory, eos_model, "eos-unified", EOS_UNIFIED_CTX, 4, "--kv-unified")


@pytest.fixture(scope="session")
def eos_shift_server(tmp_path_factory: pytest.TempPathFactory, eos_model: Path) -> Iterator[LlamaServer]:
    """Answers end on their own; 4 slots of 256 with --context-shift: a slot that fills drops the
    oldest tokens after n_keep (the head of the prompt) and goes on to the answer's end."""
    yield from _server(tmp_path_factory, eos_model, "eos-shift", EOS_SPLIT_CTX, 4, "--context-shift")


def _python_server(tmp_path_factory: pytest.TempPathFactory, model: Path, name: str) -> Iterator[LlamaCppPythonServer]:
    server = LlamaCppPythonServer(model)
    server.start(tmp_path_factory.mktemp("llama-cpp-python") / f"{name}.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def python_server(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[LlamaCppPythonServer]:
    """llama-cpp-python's server, its default interrupt_requests on; the model never samples EOS."""
    yield from _python_server(tmp_path_factory, tiny_model, "python")


@pytest.fixture(scope="session")
def python_eos_server(tmp_path_factory: pytest.TempPathFactory, eos_model: Path) -> Iterator[LlamaCppPythonServer]:
    """The same, with answers that end on their own after 40 characters."""
    yield from _python_server(tmp_path_factory, eos_model, "python-eos")


@pytest.fixture
async def proxy_for() -> AsyncIterator[object]:
    """A factory: `await proxy_for(upstream_url)` starts a proxy on ephemeral ports, closed after the test."""
    from proxy.config import HostPort, ProxyConfig
    from proxy.serve.app import start_proxy

    started: list[object] = []

    async def start(upstream: str, **overrides: object) -> object:
        running = await start_proxy(
            ProxyConfig(
                upstream=upstream,
                listen=HostPort("127.0.0.1", 0),
                admin_listen=HostPort("127.0.0.1", 0),
                upstream_metrics="off",
                **overrides,  # type: ignore[arg-type]
            )
        )
        started.append(running)
        return running

    yield start
    for running in reversed(started):
        await running.close()  # type: ignore[attr-defined]
