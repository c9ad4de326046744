"""Two builds of the proxy measured at once, side by side on one core, under the same paced load.

Run after run, this machine's speed moves by 10-50 % within minutes (docs/overhead.md), more than
most changes to the relay are worth. Two proxies pinned to the same CPU, each driven with half
the streams in the same window by one generator against one upstream, meet the same speed: their
ratio holds to about 2 % (the same build against itself: 1.008 and 1.018), where two runs one
after the other differ by up to 15 %.

The load is the independent harness's (`../shared/bench/overhead`: a raw asyncio upstream whose
engine writes one event per write to every stream at each step, the generator's raw sockets),
so what this says is what that harness measures.

    python3 benchmarks/side_by_side.py --a /tmp/base --b . [--b-args "--history off"] [--tokens 50]

`--a`/`--b`: source trees to run (`PYTHONPATH`); each is started with the defaults users run (the
history to a fresh SQLite file, records logged) plus its own extra arguments. Prints CPU per event
of each, the ratio B/A, and TTFT p50/p99, per round and over all rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.overhead import (  # noqa: E402
    HARNESS,
    free_port,
    harness_loadgen,
    start_harness_upstream,
    stop_all,
    wait_for,
)


def start_proxy(tree: Path, upstream: int, extra: str, tmp: Path, name: str) -> tuple[subprocess.Popen[bytes], int]:
    port, admin = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    command = ["taskset", "-c", "1", sys.executable, "-m", "proxy", "serve",
               "--upstream", f"http://127.0.0.1:{upstream}", "--listen", f"127.0.0.1:{port}",
               "--admin-listen", f"127.0.0.1:{admin}", "--history", str(tmp / f"{name}.db"), *shlex.split(extra)]
    log = (tmp / f"{name}.log").open("wb")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    wait_for(port)
    return process, port


async def one_round(loadgen: object, ports: tuple[int, int], pids: tuple[int, int], upstream_pid: int,
                    tokens: int, streams: int, seconds: float) -> list[dict[str, float]]:
    mode = {"name": "paced", "tokens": tokens, "delay_ms": 20.0, "per_write": 1}
    targets = [{"name": name, "host": "127.0.0.1", "port": port, "pid": pid}
               for name, port, pid in zip("AB", ports, pids, strict=True)]
    run_window = loadgen.run_window  # type: ignore[attr-defined]
    pct = loadgen.pct  # type: ignore[attr-defined]
    windows = await asyncio.gather(*(run_window(target, mode, streams, 1.0, seconds, upstream_pid)
                                     for target in targets))
    return [{"us": window["cpu_proxy"] / max(1, window["tokens"]) * 1e6,
             "ttft_p50": pct(window["ttft"], 50) * 1e3, "ttft_p99": pct(window["ttft"], 99) * 1e3,
             "ttft": window["ttft"], "bad": window["bad"]} for window in windows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, required=True, help="the source tree measured as A (the before)")
    parser.add_argument("--b", type=Path, required=True, help="the source tree measured as B (the after)")
    parser.add_argument("--a-args", default="", help="extra `serve` arguments for A")
    parser.add_argument("--b-args", default="", help="extra `serve` arguments for B")
    parser.add_argument("--tokens", type=int, default=50, help="tokens per answer, one per write, 20 ms apart")
    parser.add_argument("--streams", type=int, default=32, help="streams per proxy (64 in all by default)")
    # Long enough that the proxy's periodic work (records delivered in batches of up to 0.5 s, the
    # history's writes every second) falls whole inside a round, give or take one batch of ~40.
    parser.add_argument("--seconds", type=float, default=20.5, help="measured seconds per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    loadgen = harness_loadgen()
    if loadgen is None:
        print(f"side_by_side: the independent harness is not at {HARNESS}", file=sys.stderr)
        return 2
    for tree in (args.a, args.b):
        if not (tree / "proxy" / "__main__.py").exists():
            print(f"side_by_side: {tree} is not a source tree of the proxy", file=sys.stderr)
            return 2
    import uvloop

    uvloop.install()  # the generator on the loop the harness runs it on (asyncio's own slowed its TTFTs)

    processes: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="side-by-side-") as name:
        tmp = Path(name)
        try:
            upstream, upstream_port = start_harness_upstream()
            processes.append(upstream)
            a, a_port = start_proxy(args.a, upstream_port, args.a_args, tmp, "a")
            processes.append(a)
            b, b_port = start_proxy(args.b, upstream_port, args.b_args, tmp, "b")
            processes.append(b)
            os.sched_setaffinity(0, {0})  # the generator beside the upstream, as the harness runs it
            asyncio.run(one_round(loadgen, (a_port, b_port), (a.pid, b.pid), upstream.pid, args.tokens, 4, 1.0))
            rows = []
            print(f"{args.tokens} tokens per answer, {args.streams} paced streams per proxy, both on CPU 1")
            for number in range(1, args.rounds + 1):
                first, second = asyncio.run(one_round(loadgen, (a_port, b_port), (a.pid, b.pid), upstream.pid,
                                                      args.tokens, args.streams, args.seconds))
                rows.append((first, second))
                print(f"round {number}: A {first['us']:.1f} us/event (TTFT {first['ttft_p50']:.2f}/"
                      f"{first['ttft_p99']:.2f} ms), B {second['us']:.1f} (TTFT {second['ttft_p50']:.2f}/"
                      f"{second['ttft_p99']:.2f} ms), B/A {second['us'] / first['us']:.3f}, "
                      f"bad {first['bad']:.0f}/{second['bad']:.0f}")
            mean_a = sum(row[0]["us"] for row in rows) / len(rows)
            mean_b = sum(row[1]["us"] for row in rows) / len(rows)
            ratios = sorted(row[1]["us"] / row[0]["us"] for row in rows)
            pct = loadgen.pct  # type: ignore[attr-defined]
            ttfts = [[t for row in rows for t in row[side]["ttft"]] for side in (0, 1)]
            print(f"all rounds: A {mean_a:.1f} us/event, B {mean_b:.1f}, B/A {mean_b / mean_a:.3f} "
                  f"(rounds {ratios[0]:.3f}-{ratios[-1]:.3f}); TTFT p50/p90/p99 of every round's answers: "
                  + ", ".join(f"{side} {pct(t, 50) * 1e3:.2f}/{pct(t, 90) * 1e3:.2f}/{pct(t, 99) * 1e3:.2f} ms"
                              for side, t in zip("AB", ttfts, strict=True)))
        finally:
            stop_all(processes[::-1], signal.SIGINT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
