"""The concurrency sweep through the proxy against a real vLLM (CPU build): the tables in docs/vllm.md.

The model (tests/real_servers/vllm/make_tiny_hf_model.py) ends every chat answer with EOS after 250 tokens.
vLLM runs with a KV cache of 24 blocks of 32 tokens (768 tokens) and a 512-token context:
- a short prompt at concurrency 1, 2, 4, 8: eight 260-token answers do not fit in 768 tokens,
  so the scheduler preempts and recomputes, and yet every answer completes;
- a 324-token prompt: only 188 tokens of the 512-token context remain for the answer, so vLLM
  silently clamps `max_tokens` 300 to 188 at every level.
Run after `bash tools/setup_vllm_cpu.sh`: `python -m tests.real_servers.vllm.sweep_demo`.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from proxy.sweep.session import SweepOutcome
from tests.real_servers.vllm.conftest import EOS_AFTER
from tests.real_servers.vllm.vllm_server import SERVED_NAME, VllmServer, make_model
from tests.support.proxies import start_served
from tests.support.sweeps import sweep_through

MAX_TOKENS = 300  # more than the 251 an answer takes: a length stop is the server's doing
SHORT_PROMPT = "hello"
LONG_PROMPT = "uba ubi " * 80  # 324 prompt tokens with the chat template
SCENARIOS = (
    ("preemption without truncation: concurrency 1-8 on a 768-token KV cache", SHORT_PROMPT, (1, 2, 4, 8)),
    ("a clamp: a 324-token prompt in a 512-token context", LONG_PROMPT, (1, 2, 4)),
)


async def sweep(server: VllmServer, prompt: str, levels: tuple[int, ...], repeats: int = 2) -> tuple[SweepOutcome, str]:
    """One sweep through a fresh proxy that polls vLLM's /metrics every 0.1 s.

    The proxy runs as deployed, `llm-diag-proxy serve` in its own process, not in the sweep's
    event loop: the sweep's clients would slow the proxy's loop, which a user's do not.
    """
    with tempfile.TemporaryDirectory() as tmp:
        served = await start_served(server.url, Path(tmp), "--upstream-metrics", "vllm",
                                    "--upstream-metrics-interval", "0.1", "--no-log-records")
        try:
            return await sweep_through(served.proxy_url, served.admin_url, prompt=prompt, levels=levels,
                                       repeats=repeats, model=SERVED_NAME, max_tokens=MAX_TOKENS, timeout_s=120.0,
                                       warmup=3)
        finally:
            served.stop()


async def main_async() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = VllmServer(make_model(Path(tmp) / "tiny", EOS_AFTER))
        server.start(Path(tmp) / "vllm.log")
        try:
            for title, prompt, levels in SCENARIOS:
                _, printed = await sweep(server, prompt, levels)
                print(f"### {title}\n\n```\n{printed.strip()}\n```\n")
        finally:
            server.stop()


if __name__ == "__main__":
    asyncio.run(main_async())
