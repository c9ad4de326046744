"""Paced events per second at saturation: the proxy on one core, then `--workers N` on N cores.

Real servers write one event per token, each in a write of its own. This raises the number of
such streams through the proxy until it relays no more (less than 0.9 of what direct gives, or
its cores 95 % busy): its events per second at saturation, first as one process pinned to one
core, then as N workers (and their supervisor) pinned to N cores, and says how close N workers
come to N times one (issue 29 asks at least 0.9·N).

The load side gets the other cores: several upstream processes sharing one port (SO_REUSEPORT,
the stream of `overhead.py`: a role chunk, one event per token at `--interval`, the finish, the
usage, [DONE]) and several generator processes, each running its share of the streams, one after
another, and counting the events that reach it in the measured window. Each level runs direct
too, so a load side that cannot offer more shows as such rather than as a relay that saturated.
The relay's cores busy (its processes' CPU over the window) are shown beside each figure.

    python benchmarks/scaling.py --workers 4          # needs 4 cores for the relay, more for the load
    python benchmarks/scaling.py --workers 8 --levels 256,512,1024,2048,4096
    python benchmarks/scaling.py --workers 2 --relay-cores 1 --levels 64   # the supervisor's cost, on 2 CPUs

With N workers it also says what their supervisor spent (its own process, not its workers) per
record relayed in the window: it does no work per record, so this is what reading its admin
listener and passing telemetry on costs, spread over the records (issue 40 asks at most 10 µs).

Never run as a timed test: the figures depend on the machine. Two cores cannot show scaling (one
relay core, one load core); on them it runs `--workers 1` only, as a check that the script works.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import overhead  # the upstream's stream, the process tree's CPU

ROOT = Path(__file__).resolve().parents[1]
WARM_S = 1.5  # from the first stream's start to the window's
SETTLE_FACTOR = 0.9  # a relay relays what was offered while it gives at least this share of direct
BUSY = 0.95  # or while its cores are less busy than this: past either, it is saturated


# --- a generator: its share of the streams, events counted in the window ------------------------
async def generate(url: str, streams: int, interval: float, start: float, window: tuple[float, float]) -> int:
    counted = 0
    body = {"model": "bench", "stream": True, "messages": [{"role": "user", "content": "x"}],
            "stream_options": {"include_usage": True}}
    headers = {"X-Bench-Interval": str(interval)}
    stop = window[1]

    async def one(session: aiohttp.ClientSession, index: int) -> None:
        nonlocal counted
        await asyncio.sleep(max(0.0, start - time.time()) + index * interval * 50 / max(1, streams))
        while time.time() < stop:
            async with session.post(url, json=body, headers=headers) as response:
                async for chunk in response.content.iter_any():
                    now = time.time()
                    if window[0] <= now < stop:
                        counted += chunk.count(b"data: ")

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        await asyncio.gather(*(one(session, i) for i in range(streams)))
    return counted


# --- the run -----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pinned(cores: set[int]) -> Callable[[], None]:
    return lambda: os.sched_setaffinity(0, cores)


def start_proxy(workers: int, upstream_port: int, cores: set[int]) -> tuple[subprocess.Popen[bytes], str]:
    port, admin = free_port(), free_port()
    command = [sys.executable, "-m", "proxy", "serve", "--upstream", f"http://127.0.0.1:{upstream_port}",
               "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}", "--gpu-poll-interval", "0",
               "--upstream-metrics", "off", "--log-format", "json", "--history", "off"]
    if workers > 1:
        command += ["--workers", str(workers)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, preexec_fn=pinned(cores))
    overhead.wait_for(port)
    time.sleep(1.0 if workers > 1 else 0.2)  # every worker listening
    return process, f"http://127.0.0.1:{port}/v1/chat/completions"


EVENTS_PER_STREAM = 54  # the role chunk, 50 tokens, the finish, the usage, [DONE]


def own_cpu_seconds(pid: int) -> float:
    """CPU time of one process (its threads), not its children's."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def measure(url: str, streams: int, generators: int, load: set[int], interval: float, seconds: float,
            relay: subprocess.Popen[bytes] | None, supervisor: list[float] | None = None) -> tuple[float, float]:
    """(events per second reaching the clients in the window, the relay's cores busy meanwhile);
    `supervisor` gets the relay's own process's CPU seconds in the window (not its workers')."""
    start = time.time() + 0.5
    window = (start + WARM_S + interval * 50, start + WARM_S + interval * 50 + seconds)
    shares = [streams // generators + (1 if i < streams % generators else 0) for i in range(generators)]
    children = [subprocess.Popen([sys.executable, __file__, "--role", "generator", "--url", url,
                                  "--streams", str(share), "--interval", str(interval), "--start", str(start),
                                  "--window", f"{window[0]},{window[1]}"],
                                 stdout=subprocess.PIPE, preexec_fn=pinned(load)) for share in shares if share]
    time.sleep(max(0.0, window[0] - time.time()))
    before = overhead.cpu_seconds(relay.pid) if relay is not None else 0.0
    own_before = own_cpu_seconds(relay.pid) if relay is not None else 0.0
    time.sleep(max(0.0, window[1] - time.time()))
    used = overhead.cpu_seconds(relay.pid) - before if relay is not None else 0.0
    if relay is not None and supervisor is not None:
        supervisor.append(own_cpu_seconds(relay.pid) - own_before)
    counted = 0
    for child in children:
        out, _ = child.communicate(timeout=seconds + 120)
        counted += json.loads(out.decode().strip().splitlines()[-1])["events"]
    return counted / seconds, used / seconds


def summary(best: dict[int, tuple[float, float]], workers: int, saturated: bool, cores: int) -> None:
    one, busy = best[1]
    if not saturated:
        print("# no level saturated every relay (the load side's cores may be the limit: see whether direct still "
              "grew); the figures below are the most relayed, not the most relayable")
    per_event = busy / one if one else 0.0
    print(f"# one worker: {one:,.0f} events/s on one core, {busy:.2f} of it busy: {per_event * 1e6:.0f} us of CPU per "
          f"event, so about {1 / per_event if per_event else 0:,.0f} events/s per core (an estimate where not "
          f"saturated), {50 / 54 / per_event if per_event else 0:,.0f} tokens/s of 50-token streams")
    if workers > 1:
        many = best[workers][0]
        scale = many / one / workers if one else 0.0
        if cores < workers:
            print(f"# {workers} workers on {cores} core(s): {many:,.0f} events/s (not a scaling figure: the "
                  "supervisor's cost per record is the column above)")
            return
        print(f"# {workers} workers: {many:,.0f} events/s on {workers} cores, {scale:.2f}·N of one worker "
              "(target: at least 0.9·N, both saturated)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=0, help="N (default: half the cores, at least 1)")
    parser.add_argument("--levels", default="", help="streams per level (default: 64, doubling to 32·64 per core)")
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between tokens")
    parser.add_argument("--seconds", type=float, default=4.0, help="the measured window of each level")
    parser.add_argument("--upstreams", type=int, default=0, help="upstream processes (default: the load cores)")
    parser.add_argument("--relay-cores", type=int, default=0,
                        help="cores for the relay (default: one per worker; fewer measures the supervisor's cost "
                             "per record where the cores are few, not the scaling)")
    parser.add_argument("--role", choices=("bench", "upstream", "generator"), default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--url", default="", help=argparse.SUPPRESS)
    parser.add_argument("--streams", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--start", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--window", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "upstream":
        overhead.run_upstream(args.port, 50, reuse_port=True)  # (paced by the X-Bench-Interval header)
        return 0
    if args.role == "generator":
        import uvloop

        low, high = (float(x) for x in args.window.split(","))
        events = uvloop.run(generate(args.url, args.streams, args.interval, args.start, (low, high)))
        print(json.dumps({"events": events}))
        return 0

    cores = sorted(os.sched_getaffinity(0))
    workers = args.workers or max(1, len(cores) // 2)
    relay_count = args.relay_cores or workers
    if len(cores) < relay_count + 1:
        print(f"error: --workers {workers} needs {relay_count + 1} cores or more (this machine gives {len(cores)}); "
              "--relay-cores 1 runs them on fewer, for the supervisor's cost", file=sys.stderr)
        return 2
    relay_cores, load = cores[:relay_count], set(cores[relay_count:])
    levels = ([int(x) for x in args.levels.split(",")] if args.levels
              else [64 * 2 ** i for i in range(12) if 64 * 2 ** i <= 32 * 64 * workers])
    upstreams = args.upstreams or len(load)
    port = free_port()
    processes = [subprocess.Popen([sys.executable, __file__, "--role", "upstream", "--port", str(port)],
                                  preexec_fn=pinned(load)) for _ in range(upstreams)]
    overhead.wait_for(port)
    time.sleep(0.5)
    configs = [(1, {relay_cores[0]})] + ([(workers, set(relay_cores))] if workers > 1 else [])
    print(f"# {time.strftime('%Y-%m-%d')}: paced events per second at saturation; {len(cores)} CPUs: the relay on "
          f"CPU {','.join(map(str, relay_cores))}, {upstreams} upstream processes and {len(load)} generators on "
          f"CPU {','.join(map(str, sorted(load)))}; 50-token streams, one event every {args.interval * 1000:.0f} ms "
          f"in a write of its own, {args.seconds:.0f} s measured per level")
    header = ("streams   direct ev/s" + "".join(f"   w{n} ev/s  share  busy" for n, _ in configs)
              + ("  supervisor us/record" if workers > 1 else ""))
    print(header)
    best = {n: (0.0, 0.0) for n, _ in configs}  # the most events/s relayed, and the cores busy meanwhile
    generators = len(load)
    proxies: dict[int, tuple[subprocess.Popen[bytes], str]] = {}
    saturated = False
    try:
        for n, relay in configs:
            proxies[n] = start_proxy(n, port, relay)
        for streams in levels:
            direct, _ = measure(f"http://127.0.0.1:{port}/v1/chat/completions", streams, generators, load,
                                args.interval, args.seconds, None)
            row = f"{streams:7d} {direct:13,.0f}"
            saturated = True
            for n, _ in configs:
                process, url = proxies[n]
                own: list[float] = []
                relayed, busy = measure(url, streams, generators, load, args.interval, args.seconds, process, own)
                best[n] = max(best[n], (relayed, busy))
                share = relayed / direct if direct else 0.0
                saturated = saturated and (share < SETTLE_FACTOR or busy >= BUSY * min(n, len(relay_cores)))
                row += f" {relayed:11,.0f} {share:6.2f} {busy:5.2f}"
                if n > 1:
                    records = relayed * args.seconds / EVENTS_PER_STREAM
                    row += f" {own[0] / records * 1e6 if records else 0.0:21.1f}"
            print(row, flush=True)
            if saturated:
                break
        summary(best, workers, saturated, len(relay_cores))
    finally:
        overhead.stop_all([p for p, _ in proxies.values()] + processes, timeout_s=20)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
