"""What big bodies cost the proxy in memory: its RSS before, at peak and after waves of concurrent
large request bodies and large non-streaming JSON answers.

The upstream (its own process) reads each request whole and answers either a small chat
completion or, when asked with `X-Bench-Answer-MiB`, one whose content is that many MiB. The proxy
runs as `python -m proxy serve`; its RSS is read from /proc every 5 ms while a wave runs, and its
records (through the admin API) say how many bodies were read and how many passed unread.

    python benchmarks/memory.py                         # the default waves, default bytes held for parsing (256 MiB)
    python benchmarks/memory.py --parse-bytes 67108864  # the same, 64 MiB held for parsing at most
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.overhead import free_port, wait_for  # noqa: E402

MIB = 1 << 20


# --- the upstream ----------------------------------------------------------------------------
def answer(content_bytes: int) -> bytes:
    return orjson.dumps({
        "id": "chatcmpl-mem", "object": "chat.completion", "created": 1733000000, "model": "bench",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "a" * content_bytes},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 40, "total_tokens": 52},
    })


def run_upstream(port: int) -> None:
    small = answer(200)
    big: dict[int, bytes] = {}

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        mib = int(request.headers.get("X-Bench-Answer-MiB", "0"))
        if not mib:
            return web.Response(body=small, content_type="application/json")
        if mib not in big:
            big[mib] = answer(mib * MIB)
        return web.Response(body=big[mib], content_type="application/json")

    app = web.Application(client_max_size=1 << 40)
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# --- measuring -----------------------------------------------------------------------------------
def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class PeakRss:
    """The highest RSS of a process while the `with` block runs, sampled every 5 ms."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mib(self.pid))
            time.sleep(0.005)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass(frozen=True)
class Wave:
    name: str
    parallel: int
    request_mib: int  # size of each request body (its message content)
    answer_mib: int  # size of each answer's content, 0 = a small answer


def body(mib: int) -> bytes:
    return orjson.dumps({"model": "bench", "stream": False,
                         "messages": [{"role": "user", "content": "q" * max(1, mib * MIB - 100)}]})


async def send_wave(url: str, wave: Wave) -> list[str]:
    payload = body(wave.request_mib)
    headers = {"Content-Type": "application/json", "X-Bench-Answer-MiB": str(wave.answer_mib)}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one() -> str:
            async with session.post(url, data=payload, headers=headers) as response:
                await response.read()
                return response.headers["X-Request-Id"]
        return list(await asyncio.gather(*(one() for _ in range(wave.parallel))))


async def records(admin: str, ids: list[str]) -> list[dict[str, object]]:
    async with aiohttp.ClientSession() as session, \
            session.get(f"{admin}/api/requests", params={"limit": "1000"}) as response:
        page = orjson.loads(await response.read())
    return [r for r in page["records"] if r["request_id"] in set(ids)]


def settle(pid: int, seconds: float = 2.0) -> float:
    time.sleep(seconds)
    return rss_mib(pid)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parse-bytes", type=int, default=0, help="the proxy's --parse-bytes (default: its own)")
    parser.add_argument("--role", choices=("bench", "upstream"), default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "upstream":
        run_upstream(args.port)
        return 0
    waves = [Wave("6 x 30 MiB requests", 6, 30, 0), Wave("12 x 30 MiB requests", 12, 30, 0),
             Wave("6 x 20 MiB JSON answers", 6, 0, 20), Wave("6 x 40 MiB JSON answers", 6, 0, 40)]
    up_port, proxy_port, admin_port = free_port(), free_port(), free_port()
    upstream = subprocess.Popen([sys.executable, __file__, "--role", "upstream", "--port", str(up_port)])
    parse_bytes = ["--parse-bytes", str(args.parse_bytes)] if args.parse_bytes else []
    proxy = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--upstream", f"http://127.0.0.1:{up_port}",
         "--listen", f"127.0.0.1:{proxy_port}", "--admin-listen", f"127.0.0.1:{admin_port}", *parse_bytes,
         "--gpu-poll-interval", "0", "--upstream-metrics", "off", "--no-log-records", "--log-format", "json"],
        cwd=ROOT, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{proxy_port}/v1/chat/completions"
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        wait_for(up_port)
        wait_for(proxy_port)
        wait_for(admin_port)
        for mib in (20, 40):  # the upstream builds its big answers once, before anything is measured
            asyncio.run(send_wave(url, Wave("warm", 1, 0, mib)))
        asyncio.run(send_wave(url, Wave("warm", 4, 1, 0)))
        print(f"# proxy RSS in MiB; bytes held for parsing at most "
              f"{f'{args.parse_bytes / MIB:g} MiB' if args.parse_bytes else 'default (256 MiB)'}, "
              f"body cap default (32 MiB)")
        print(f"{'wave':<26} {'before':>7} {'peak':>7} {'added':>7} {'after':>7}  bodies read / passed unread")
        for wave in waves:
            before = settle(proxy.pid)
            with PeakRss(proxy.pid) as peak:
                ids = asyncio.run(send_wave(url, wave))
            after = settle(proxy.pid)
            found = asyncio.run(records(admin, ids))
            if wave.request_mib:
                unread = sum(1 for r in found if r["request_note"])
            else:
                unread = sum(1 for r in found if r["parse_error"])
            print(f"{wave.name:<26} {before:7.1f} {peak.peak:7.1f} {peak.peak - before:+7.1f} {after:7.1f}  "
                  f"{len(found) - unread} / {unread}")
    finally:
        for process in (proxy, upstream):
            process.terminate()
            process.wait(timeout=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
