"""What a relay's per-answer work costs the first token, by where it runs: a budget for the paced TTFT.

At one event per write the independent harness's engine writes every stream's next token in one
step, and the generator sends a stream's next request the moment its answer ends, inside that
step's burst. A request's first token then waits for the burst, for the work of the answers that
ended in the same step (several, in some steps: the p99), for the other new requests' work, and
for its own. This measures that with the raw asyncio relay (`benchmarks/raw_passthrough.py`) made
to do a fixed amount of CPU per answer at the three places a relay does its per-answer work (before
the request is written upstream, before the answer's first bytes go to the client, at its end
before the client's next request is read), under the harness's upstream and generator (64 paced
streams, 50 tokens, one event per write; the relay alone on CPU 1). With `--proxy TREE` the proxy
itself (its defaults, the history on) is measured in the same run, between the grid's rows.

    python3 benchmarks/path_budget.py [--proxy .] [--grid "0,0,0 100,100,0 300,200,400"] [--rounds 2]

Prints per row: CPU per event, TTFT p50 and p99 over the rounds' answers, and the direct TTFT
(no relay) of the same run. Never run as a timed test.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

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

GRID = "0,0,0 100,100,0 100,100,200 200,150,0 200,150,150 300,200,0 300,200,400"


def start(command: list[str], port: int, cwd: Path) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(["taskset", "-c", "1", sys.executable, *command], cwd=cwd,
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    wait_for(port)
    return process


async def measure(loadgen: Any, port: int, pid: int | None, upstream_pid: int, rounds: int,
                  seconds: float) -> dict[str, float]:
    mode = {"name": "paced", "tokens": 50, "delay_ms": 20.0, "per_write": 1}
    target = {"name": "t", "host": "127.0.0.1", "port": port, "pid": pid}
    cpu = tokens = 0.0
    ttft: list[float] = []
    for _ in range(rounds):
        window = await loadgen.run_window(target, mode, 64, 1.5, seconds, upstream_pid)
        cpu += window["cpu_proxy"]
        tokens += window["tokens"]
        ttft += window["ttft"]
    return {"us": cpu / max(1.0, tokens) * 1e6, "p50": loadgen.pct(ttft, 50) * 1e3,
            "p99": loadgen.pct(ttft, 99) * 1e3, "n": len(ttft)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", default=GRID, help="request,head,end microseconds per answer, rows apart")
    parser.add_argument("--proxy", type=Path, help="a source tree of the proxy, measured in the same run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per round")
    args = parser.parse_args()
    try:
        grid = [tuple(float(part) for part in row.split(",")) for row in args.grid.split()]
    except ValueError:
        grid = []
    if not grid or any(len(row) != 3 for row in grid):
        print("path_budget: --grid takes rows of request,head,end microseconds, e.g. \"0,0,0 100,100,0\"",
              file=sys.stderr)
        return 2
    if args.rounds < 1 or not args.seconds > 0 or any(part < 0 for row in grid for part in row):
        print("path_budget: --rounds takes 1 or more, --seconds and the grid's microseconds 0 or more", file=sys.stderr)
        return 2
    if args.proxy is not None and not (args.proxy / "proxy" / "__main__.py").exists():
        print(f"path_budget: {args.proxy} is not a source tree of the proxy", file=sys.stderr)
        return 2
    loadgen = harness_loadgen()
    if loadgen is None:
        print(f"path_budget: the independent harness is not at {HARNESS}", file=sys.stderr)
        return 2
    import uvloop

    uvloop.install()  # the generator on the loop the harness runs it on

    processes: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="path-budget-") as name:
        tmp = Path(name)
        try:
            upstream, upstream_port = start_harness_upstream()
            processes.append(upstream)
            os.sched_setaffinity(0, {0})  # the generator beside the upstream, as the harness runs it
            direct = asyncio.run(measure(loadgen, upstream_port, None, upstream.pid, args.rounds, args.seconds))
            print(f"64 paced streams, 50 tokens, {args.rounds} rounds of {args.seconds:g} s per row; "
                  f"direct TTFT p50/p99 {direct['p50']:.2f}/{direct['p99']:.2f} ms")
            print(f"{'relay':<34} {'us/event':>9} {'TTFT p50':>9} {'p99 ms':>7}")
            rows: list[tuple[str, list[str]]] = [
                (f"raw relay +{r:g}/{h:g}/{e:g} us", [str(ROOT / "benchmarks" / "raw_passthrough.py"),
                                                    "--request-us", str(r), "--head-us", str(h),
                                                    "--end-us", str(e)]) for r, h, e in grid]
            if args.proxy is not None:  # first and last: the hour's drift shows
                proxy = ["-m", "proxy", "serve", "--history", str(tmp / "history.db")]
                rows = [("the proxy (defaults)", proxy), *rows, ("the proxy (defaults), again", proxy)]
            for label, command in rows:
                port, admin = free_port(), free_port()
                cwd = args.proxy.resolve() if command[0] == "-m" and args.proxy is not None else ROOT
                process = start([*command, "--upstream", f"http://127.0.0.1:{upstream_port}", "--listen",
                                 f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}"], port, cwd)
                processes.append(process)
                row = asyncio.run(measure(loadgen, port, process.pid, upstream.pid, args.rounds, args.seconds))
                stop_all([process])
                processes.remove(process)
                print(f"{label:<34} {row['us']:9.1f} {row['p50']:9.2f} {row['p99']:7.2f}")
        finally:
            stop_all(processes[::-1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
