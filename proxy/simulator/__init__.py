"""A built-in inference-server simulator: short answers without a GPU, for demos and tests.

It speaks vLLM's OpenAI-compatible API and Ollama's native API, and models the mechanisms that
end answers early (a full KV cache, per-slot context, a hidden deadline), each switchable.
The HTTP part is imported on first use, so `llm-diag-proxy --help` stays fast.

Stands beside the proxy: must not import anything of it but config.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from proxy.simulator.settings import SCENARIOS, SimulatorConfig

if TYPE_CHECKING:
    from proxy.simulator.server import RunningSimulator, build_app, start_simulator

__all__ = ["SCENARIOS", "RunningSimulator", "SimulatorConfig", "build_app", "start_simulator"]
_SERVER_NAMES = frozenset({"RunningSimulator", "build_app", "start_simulator"})


def __getattr__(name: str) -> Any:
    if name in _SERVER_NAMES:
        return getattr(importlib.import_module("proxy.simulator.server"), name)
    raise AttributeError(f"module 'proxy.simulator' has no attribute {name!r}")
