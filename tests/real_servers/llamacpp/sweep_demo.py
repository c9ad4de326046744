"""The concurrency sweep through the proxy against real llama-servers: the tables in docs/llamacpp.md.

The model ends every answer with EOS after 40 characters (41 tokens). Three geometries: one
512-token slot (all fit, they queue); 1024 split into 4 slots of 256 (a 227-token prompt: no
answer fits); 4 slots in a unified 512-token pool (a 403-token prompt: one answer fits, a
second prompt beside it does not).
A prompt larger than a slot is refused at every level; llama-cpp-python's own server (when
tools/setup_llama_cpp_python.sh has run) interrupts a running stream when another queues.
Run after `bash tools/build_llama_server.sh`: `python -m tests.real_servers.llamacpp.sweep_demo`.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from proxy.config import HostPort, ProxyConfig
from proxy.serve.app import start_proxy
from proxy.sweep.session import SweepOutcome
from tests.real_servers.llamacpp import llama_cpp_python_server
from tests.real_servers.llamacpp.conftest import EOS_AFTER, EOS_PROMPT, UNIFIED_PROMPT
from tests.real_servers.llamacpp.llama_cpp_python_server import LlamaCppPythonServer
from tests.real_servers.llamacpp.llama_server import ALIAS, LlamaServer
from tests.support.sweeps import sweep_through

LEVELS = (1, 2, 4)
MAX_TOKENS = 200  # more than the 41 an answer takes: every cut is the server's
# (title, --ctx-size, --parallel, extra flags, prompt)
GEOMETRIES = (
    ("one slot of 512", 512, 1, (), EOS_PROMPT),
    ("1024 split into 4 slots of 256", 1024, 4, (), EOS_PROMPT),
    ("4 slots in one unified 512-token pool", 512, 4, ("--kv-unified",), UNIFIED_PROMPT),
    ("a prompt larger than a slot: 300 characters for 256-token slots", 1024, 4, (), "x" * 300),
)


async def sweep(server: LlamaServer | LlamaCppPythonServer, prompt: str, levels: tuple[int, ...] = LEVELS,
                repeats: int = 2) -> tuple[SweepOutcome, str]:
    """One sweep through a fresh proxy; returns the outcome and what it printed."""
    running = await start_proxy(
        ProxyConfig(upstream=server.url, listen=HostPort("127.0.0.1", 0),
                    admin_listen=HostPort("127.0.0.1", 0), upstream_metrics="off"),
        log_records=False)
    try:
        return await sweep_through(running.proxy_url, running.admin_url, prompt=prompt, levels=levels,
                                   repeats=repeats, model=ALIAS, max_tokens=MAX_TOKENS, timeout_s=60.0, warmup=1)
    finally:
        await running.close()


async def main_async() -> None:
    from tests.real_servers.llamacpp.make_tiny_gguf import write_tiny_gguf  # needs numpy, unlike the tests' imports

    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_gguf(Path(tmp) / "tiny-eos.gguf", eos_after=EOS_AFTER)
        for title, ctx, parallel, extra, prompt in GEOMETRIES:
            server = LlamaServer(model, ctx, parallel, extra)
            server.start(Path(tmp) / "server.log")
            try:
                _, printed = await sweep(server, prompt)
            finally:
                server.stop()
            flags = " ".join(("--ctx-size", str(ctx), "--parallel", str(parallel), *extra))
            print(f"### {title} (`{flags}`)\n\n```\n{printed.strip()}\n```\n")
        if llama_cpp_python_server.available():
            python = LlamaCppPythonServer(model)
            python.start(Path(tmp) / "python.log")
            try:
                _, printed = await sweep(python, EOS_PROMPT, levels=(1, 2), repeats=3)
            finally:
                python.stop()
            print(f"### llama-cpp-python's server (`python -m llama_cpp.server --n_ctx 1024`)\n\n"
                  f"```\n{printed.strip()}\n```\n")


if __name__ == "__main__":
    asyncio.run(main_async())
