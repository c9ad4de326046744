"""How long SIGTERM takes with many streams open, and what becomes of them.

The simulator (its own process) streams slowly enough that no answer ends during the run; the
proxy (`python -m proxy serve --shutdown-grace G`) relays --streams of them; then the proxy gets
SIGTERM. Measured: when new connections were first refused, when the process exited, how many
clients saw the visible `proxy_shutdown` event, and how many records it wrote before exiting.

    python benchmarks/shutdown.py                    # 500 streams, grace 5 s
    python benchmarks/shutdown.py --grace 20         # the default grace
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.overhead import free_port, wait_for  # noqa: E402
from tests.e2e.load.resources import raise_fd_limit  # noqa: E402


async def open_streams(url: str, count: int) -> tuple[aiohttp.ClientSession, list[aiohttp.ClientResponse]]:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    body = {"model": "sim-7b", "stream": True, "max_tokens": 10_000, "messages": [{"role": "user", "content": "x"}]}

    async def one(i: int) -> aiohttp.ClientResponse:
        response = await session.post(url, json=body, headers={"X-Request-Id": f"s-{i}"})
        await response.content.readany()  # the stream is open
        return response

    return session, list(await asyncio.gather(*(one(i) for i in range(count))))


def refused(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


async def measure(args: argparse.Namespace) -> None:
    sim_port, proxy_port, admin_port = free_port(), free_port(), free_port()
    log = tempfile.TemporaryFile()  # noqa: SIM115 - the proxy's record lines (an unread pipe would block it); closed at exit
    simulator = subprocess.Popen([sys.executable, "-m", "proxy", "simulate", "--listen", f"127.0.0.1:{sim_port}",
                                  "--scenario", "healthy", "--token-time", "0.5", "--natural-tokens", "10000",
                                  "--max-num-seqs", str(args.streams * 2)], cwd=ROOT, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
    proxy = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--upstream", f"http://127.0.0.1:{sim_port}",
         "--listen", f"127.0.0.1:{proxy_port}", "--admin-listen", f"127.0.0.1:{admin_port}",
         "--shutdown-grace", str(args.grace), "--gpu-poll-interval", "0", "--upstream-metrics", "off",
         "--log-format", "json"], cwd=ROOT, stdout=log, stderr=subprocess.DEVNULL)
    try:
        wait_for(sim_port)
        wait_for(proxy_port)
        session, responses = await open_streams(f"http://127.0.0.1:{proxy_port}/v1/chat/completions", args.streams)
        reads = [asyncio.create_task(response.read()) for response in responses]
        started = time.monotonic()
        proxy.send_signal(signal.SIGTERM)
        refused_after = None
        while proxy.poll() is None:
            if refused_after is None and refused(proxy_port):
                refused_after = time.monotonic() - started
            await asyncio.sleep(0.01)
        exited_after = time.monotonic() - started
        bodies = await asyncio.gather(*reads, return_exceptions=True)
        await session.close()
        log.seek(0)
        records = [orjson.loads(line) for line in log.read().splitlines() if b'"event":"response"' in line]
        visible = sum(1 for body in bodies if isinstance(body, bytes) and b'"type":"proxy_shutdown"' in body)
        reasons: dict[str, int] = {}
        for record in records:
            reasons[record["stop_reason"]] = reasons.get(record["stop_reason"], 0) + 1
        print(f"# {args.streams} open streams, --shutdown-grace {args.grace:g}")
        print(f"new connections refused after {refused_after or 0:.2f} s; process exited after {exited_after:.2f} s "
              f"(exit code {proxy.returncode})")
        print(f"clients that saw the proxy_shutdown event: {visible} of {args.streams}; records written: "
              f"{len(records)} {reasons}")
    finally:
        for process in (proxy, simulator):
            if process.poll() is None:
                process.terminate()
            process.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--grace", type=float, default=5.0)
    args = parser.parse_args()
    raise_fd_limit(4 * args.streams + 100)
    asyncio.run(measure(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
