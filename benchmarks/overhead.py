"""What the proxy costs: token throughput and time to first token, direct vs through the proxy.

One run starts a fast upstream (its own process, streaming 1,000-token SSE responses), the
proxy (its own process, `python -m proxy serve`), and a load generator here, at 1, 8 and 64
concurrent streams, first direct, then through the proxy. It prints tokens/s both ways, their
ratio, the TTFT the proxy adds (p50, p99) and the proxy's CPU time per relayed chunk; then the
TTFT of single requests to the idle server, direct and proxied in turn.

    python benchmarks/overhead.py                      # paced like a real server (5 ms/token)
    python benchmarks/overhead.py --token-interval 0   # unpaced: as fast as the upstream can write
    python benchmarks/overhead.py --baseline           # aiohttp alone: the floor of the stack
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- the upstream (runs in its own process) ------------------------------------------------
def token_chunk(i: int) -> bytes:
    return b"data: " + orjson.dumps({
        "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1733000000, "model": "bench",
        "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "logprobs": None, "finish_reason": None}],
    }) + b"\n\n"


def run_upstream(port: int, tokens: int, interval: float) -> None:
    chunks = [token_chunk(i) for i in range(tokens)]
    final = b"data: " + orjson.dumps({
        "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1733000000, "model": "bench",
        "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length", "stop_reason": None}],
    }) + b"\n\n" + b"data: [DONE]\n\n"

    async def stream(request: web.Request) -> web.StreamResponse:
        asked = orjson.loads(await request.read()).get("max_tokens") or tokens
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for i, chunk in enumerate(chunks[:asked]):
            if interval:
                delay = start + i * interval - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
            await response.write(chunk)
        await response.write(final)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", stream)
    import uvloop

    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# --- the load generator ----------------------------------------------------------------------
async def one_stream(session: aiohttp.ClientSession, url: str, max_tokens: int) -> tuple[float, int]:
    started = time.perf_counter()
    ttft = -1.0
    tokens = 0
    body = {"model": "bench", "stream": True, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "x"}]}
    async with session.post(url, json=body) as response:
        async for chunk in response.content.iter_any():
            if ttft < 0:
                ttft = time.perf_counter() - started
            tokens += chunk.count(b'"content":"tok')
    return ttft, tokens


async def level(url: str, concurrency: int, rounds: int, max_tokens: int) -> tuple[float, list[float]]:
    """Closed loop: `concurrency` streams at once, `rounds` times; returns (tokens/s, TTFTs)."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await one_stream(session, url, max_tokens)  # warm the connections
        ttfts: list[float] = []
        total = 0
        started = time.perf_counter()
        for _ in range(rounds):
            results = await asyncio.gather(*(one_stream(session, url, max_tokens) for _ in range(concurrency)))
            for ttft, tokens in results:
                ttfts.append(ttft)
                total += tokens
        elapsed = time.perf_counter() - started
    return total / elapsed, ttfts


async def idle_ttft(direct_url: str, proxied_url: str, samples: int) -> tuple[list[float], list[float]]:
    """TTFT of single requests to an otherwise idle server, direct and proxied in turn (so that
    a drift of the machine's speed hits both alike), each on a warm pooled connection."""
    direct: list[float] = []
    proxied: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for url in (direct_url, proxied_url):
            await one_stream(session, url, 1)
        for i in range(samples):
            order = ((direct_url, direct), (proxied_url, proxied))
            for url, out in order if i % 2 else order[::-1]:
                ttft, _ = await one_stream(session, url, 1)
                out.append(ttft)
    return direct, proxied


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def added_ms(direct: list[float], proxied: list[float]) -> tuple[float, float]:
    """The TTFT the proxy adds, p50 and p99, in milliseconds."""
    return ((statistics.median(proxied) - statistics.median(direct)) * 1000,
            (percentile(proxied, 0.99) - percentile(direct, 0.99)) * 1000)


def wait_for(port: int) -> None:
    for _ in range(200):
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise SystemExit(f"nothing listening on port {port}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,8,64")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2, help="closed-loop rounds per level")
    parser.add_argument("--ttft-samples", type=int, default=200,
                        help="single requests, direct and proxied in turn, for the idle TTFT (0 = skip)")
    parser.add_argument("--token-interval", type=float, default=0.005, help="seconds between tokens, 0 = unpaced")
    parser.add_argument("--baseline", action="store_true",
                        help="measure benchmarks/bare_passthrough.py (aiohttp alone) in place of the proxy")
    parser.add_argument("--role", choices=("bench", "upstream"), default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "upstream":
        run_upstream(args.port, args.tokens, args.token_interval)
        return 0
    up_port, proxy_port, admin_port = free_port(), free_port(), free_port()
    upstream = subprocess.Popen([sys.executable, __file__, "--role", "upstream", "--port", str(up_port),
                                 "--tokens", str(args.tokens), "--token-interval", str(args.token_interval)])
    proxy = subprocess.Popen(
        [sys.executable, *(["benchmarks/bare_passthrough.py"] if args.baseline else ["-m", "proxy", "serve"]),
         "--upstream", f"http://127.0.0.1:{up_port}",
         "--listen", f"127.0.0.1:{proxy_port}", "--admin-listen", f"127.0.0.1:{admin_port}",
         "--gpu-poll-interval", "0", "--upstream-metrics", "off", "--log-format", "json"],
        cwd=ROOT, stdout=subprocess.DEVNULL)
    try:
        wait_for(up_port)
        wait_for(proxy_port)
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        direct_url = f"http://127.0.0.1:{up_port}/v1/chat/completions"
        proxied_url = f"http://127.0.0.1:{proxy_port}/v1/chat/completions"
        mode = f"paced at {args.token_interval * 1000:g} ms/token" if args.token_interval else "unpaced"
        subject = "bare aiohttp pass-through (baseline)" if args.baseline else "llm-diag-proxy"
        print(f"# {subject} overhead: {args.tokens}-token SSE streams, {mode}, {args.rounds} rounds per level, "
              f"{os.cpu_count()} CPUs")
        print(f"{'streams':>7} {'direct tok/s':>13} {'proxied tok/s':>14} {'ratio':>6} "
              f"{'+TTFT p50 ms':>13} {'+TTFT p99 ms':>13} {'proxy CPU us/chunk':>19}")
        for concurrency in (int(x) for x in args.levels.split(",")):
            direct_rate, direct_ttft = asyncio.run(level(direct_url, concurrency, args.rounds, args.tokens))
            cpu_before = cpu_seconds(proxy.pid)
            proxied_rate, proxied_ttft = asyncio.run(level(proxied_url, concurrency, args.rounds, args.tokens))
            cpu_used = cpu_seconds(proxy.pid) - cpu_before
            chunks = (args.rounds * concurrency + 1) * (args.tokens + 1)
            added_p50, added_p99 = added_ms(direct_ttft, proxied_ttft)
            print(f"{concurrency:>7} {direct_rate:>13,.0f} {proxied_rate:>14,.0f} {proxied_rate / direct_rate:>6.3f} "
                  f"{added_p50:>13.2f} {added_p99:>13.2f} {cpu_used / chunks * 1e6:>19.1f}", flush=True)
        if args.ttft_samples:
            direct_ttft, proxied_ttft = asyncio.run(idle_ttft(direct_url, proxied_url, args.ttft_samples))
            added_p50, added_p99 = added_ms(direct_ttft, proxied_ttft)
            print(f"# idle TTFT, {args.ttft_samples} single requests each way, in turn: direct p50 "
                  f"{statistics.median(direct_ttft) * 1000:.2f} ms, proxied p50 "
                  f"{statistics.median(proxied_ttft) * 1000:.2f} ms, added p50 {added_p50:.2f} ms, "
                  f"added p99 {added_p99:.2f} ms")
    finally:
        for process in (proxy, upstream):
            process.terminate()
            process.wait(timeout=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
