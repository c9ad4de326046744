"""One relay measured under two load generators in turn: ours (`overhead.py`'s paced streams, aiohttp
clients) and the independent harness's (`../shared/bench/overhead/loadgen.py`, raw sockets), the
same upstream, the same minutes.

Why: the two benchmarks gave the same proxy's paced CPU per event 15-40 % apart, and their
ratios to nginx up to 38 % apart, in runs a few minutes from each other. Run in turn here, within
one minute of each other, the generators tell whether the difference is theirs (a figure both
relays share: the ratio holds) or the machine's from one minute to the next (the ratio moves).

    python3 benchmarks/generators.py [--rounds 3] [--seconds 10]

Each round measures nginx and the proxy (its defaults: the history on, records logged), each
under the harness's generator (64 closed-loop streams, a measured window after a warm-up) and
then under ours (64 slots, 4 streams each, starts spread over a stream's length). Prints CPU per
answer and per event of each, and the proxy's ratio to nginx under each generator.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.overhead import (  # noqa: E402
    HARNESS,
    NGINX_CONF,
    cpu_seconds,
    free_port,
    harness_loadgen,
    staggered,
    stop_all,
    wait_for,
)
from benchmarks.side_by_side import start_proxy  # noqa: E402

TOKENS = 50
STREAMS = 64
EVENTS = TOKENS + 3  # what both generators count as an event here: every `data: {` (role, tokens, finish, usage)


def harness_window(loadgen: object, port: int, pid: int, upstream_pid: int, seconds: float) -> tuple[float, int]:
    """CPU seconds of the relay's processes over the harness generator's window, and the answers in it."""
    build = loadgen.build_request  # type: ignore[attr-defined]

    def paced(host: str, port: int, tokens: int, delay_ms: float, per_write: int = 1) -> bytes:
        # our upstream paces by a header (the harness's own, by a body field it does not read)
        return build(host, port, tokens, delay_ms, per_write).replace(
            b"Accept: text/event-stream\r\n", b"Accept: text/event-stream\r\nX-Bench-Interval: 0.02\r\n")

    loadgen.build_request = paced  # type: ignore[attr-defined]
    try:
        mode = {"name": "paced", "tokens": TOKENS, "delay_ms": 20.0, "per_write": 1}
        target = {"name": "relay", "host": "127.0.0.1", "port": port, "pid": pid}
        window = asyncio.run(loadgen.run_window(target, mode, STREAMS, 1.0, seconds, upstream_pid))  # type: ignore[attr-defined]
    finally:
        loadgen.build_request = build  # type: ignore[attr-defined]
    return window["cpu_proxy"], window["responses"]


def ours(port: int, pid: int) -> tuple[float, int]:
    """CPU seconds of the relay's processes over overhead.py's paced streams, and the answers."""
    before = cpu_seconds(pid)
    asyncio.run(staggered(f"http://127.0.0.1:{port}/v1/chat/completions", STREAMS, 4, TOKENS, 0.02))
    return cpu_seconds(pid) - before, STREAMS * 5  # (each slot's warm-up answer, then its 4)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="the harness generator's measured window")
    args = parser.parse_args()
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    loadgen = harness_loadgen()
    if loadgen is None or not Path(nginx).exists() or len(os.sched_getaffinity(0)) < 2:
        print(f"generators: needs the harness at {HARNESS}, nginx and two CPUs", file=sys.stderr)
        return 2

    processes: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="generators-") as name:
        tmp = Path(name)
        try:
            os.sched_setaffinity(0, {0})  # the generators and the upstream on CPU 0, each relay on CPU 1
            upstream_port = free_port()
            upstream = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--role", "upstream",
                                         "--port", str(upstream_port), "--tokens", str(TOKENS)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            processes.append(upstream)
            wait_for(upstream_port)
            relays: dict[str, tuple[int, int]] = {}
            nginx_port = free_port()
            (tmp / "nginx.conf").write_text(NGINX_CONF.format(dir=tmp, upstream=upstream_port, port=nginx_port))
            process = subprocess.Popen(["taskset", "-c", "1", nginx, "-c", str(tmp / "nginx.conf"), "-p", str(tmp)],
                                       stderr=subprocess.DEVNULL)
            processes.append(process)
            relays["nginx"] = (nginx_port, process.pid)
            process, proxy_port = start_proxy(ROOT, upstream_port, "", tmp, "proxy")  # (its defaults: the history on)
            processes.append(process)
            relays["proxy"] = (proxy_port, process.pid)
            for port, _ in relays.values():
                wait_for(port)
            print(f"{TOKENS}-token answers at 20 ms per token, one event per write, {STREAMS} streams; "
                  f"us per answer (per event: / {EVENTS})")
            print(f"{'round':>5} {'relay':>6} {'harness gen':>12} {'ours':>8} {'ours/harness':>13}")
            totals = {(relay, gen): [0.0, 0] for relay in relays for gen in ("harness", "ours")}
            for number in range(1, args.rounds + 1):
                for relay, (port, pid) in relays.items():
                    spent = {"harness": harness_window(loadgen, port, pid, upstream.pid, args.seconds),
                             "ours": ours(port, pid)}
                    for gen, (cpu, answers) in spent.items():
                        totals[relay, gen][0] += cpu
                        totals[relay, gen][1] += answers
                    per = {gen: cpu / max(1, answers) * 1e6 for gen, (cpu, answers) in spent.items()}
                    print(f"{number:>5} {relay:>6} {per['harness']:>12.0f} {per['ours']:>8.0f} "
                          f"{per['ours'] / per['harness']:>13.3f}", flush=True)
            overall = {key: cpu / max(1, answers) * 1e6 for key, (cpu, answers) in totals.items()}
            for gen in ("harness", "ours"):
                nginx_us, proxy_us = overall["nginx", gen], overall["proxy", gen]
                print(f"all rounds, {gen + ' generator:':<19} nginx {nginx_us / EVENTS:.1f}, proxy "
                      f"{proxy_us / EVENTS:.1f} us/event: proxy/nginx {proxy_us / nginx_us:.2f}")
        finally:
            stop_all(processes[::-1], signal.SIGINT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
