"""Does reading the admin API stall live traffic? The worst chunk gap of a live stream through the
proxy, with and without scrapers reading the biggest page of /api/requests in a loop.

Three processes besides this one: an upstream (fast JSON answers to fill the ring, and a stream
paced at --token-interval), the proxy (`python -m proxy serve`, ring --ring-size), and --scrapers
processes that each GET /api/requests?limit=1000 back to back (following next_cursor, starting
over at the end) for as long as the stream lasts. The stream is measured here, at the client:
the gap between two chunks arriving, before and during the scrape.

    python benchmarks/admin_stall.py                       # ring of 10,000, 5 scrapers, 20 ms tokens
    python benchmarks/admin_stall.py --scrapers 0          # the stream alone, twice
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.overhead import free_port, percentile, token_chunk, wait_for  # noqa: E402

MAX_PAGE = 1000  # proxy.admin.MAX_PAGE: the biggest page a client may ask for


# --- the upstream ----------------------------------------------------------------------------
def run_upstream(port: int, interval: float) -> None:
    answer = orjson.dumps({
        "id": "chatcmpl-fill", "object": "chat.completion", "created": 1733000000, "model": "bench",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "tok " * 40},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 40, "total_tokens": 52},
    })
    final = b'data: {"id":"chatcmpl-live","object":"chat.completion.chunk","created":1733000000,"model":"bench",' \
            b'"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'

    async def chat(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        if not body.get("stream"):
            return web.Response(body=answer, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for i in range(int(body.get("max_tokens") or 100)):
            delay = start + i * interval - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await response.write(token_chunk(i))
        await response.write(final)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# --- the scraper -------------------------------------------------------------------------------
def run_scraper(admin: str, seconds: float, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    async def scrape() -> tuple[int, int, list[float]]:
        pages = records = 0
        times: list[float] = []
        cursor: str | None = None
        deadline = time.monotonic() + seconds
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                params = {"limit": str(MAX_PAGE), **({"cursor": cursor} if cursor else {})}
                started = time.perf_counter()
                async with session.get(f"{admin}/api/requests", params=params) as response:
                    page = orjson.loads(await response.read())
                times.append(time.perf_counter() - started)
                pages += 1
                records += len(page["records"])
                next_cursor = page.get("next_cursor")
                cursor = str(next_cursor) if next_cursor is not None else None
        return pages, records, times

    out.put(asyncio.run(scrape()))


# --- the measurement -----------------------------------------------------------------------------
async def fill(url: str, count: int) -> None:
    body = {"model": "bench", "stream": False, "messages": [{"role": "user", "content": "x"}]}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def worker(n: int) -> None:
            for _ in range(n):
                async with session.post(url, json=body) as response:
                    await response.read()
        await asyncio.gather(*(worker(count // 32 + (i < count % 32)) for i in range(32)))


async def live_gaps(url: str, tokens: int) -> list[float]:
    """Seconds between consecutive chunks of one stream, as the client receives them."""
    body = {"model": "bench", "stream": True, "max_tokens": tokens, "messages": [{"role": "user", "content": "x"}]}
    gaps: list[float] = []
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        last = None
        async for _chunk in response.content.iter_any():
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    return gaps


def describe(name: str, gaps: list[float]) -> str:
    return (f"{name:<28} chunks {len(gaps) + 1:>5}  gap p50 {statistics.median(gaps) * 1000:6.1f} ms  "
            f"p99 {percentile(gaps, 0.99) * 1000:6.1f} ms  worst {max(gaps) * 1000:6.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ring-size", type=int, default=10_000, help="records in the proxy's ring (filled first)")
    parser.add_argument("--scrapers", type=int, default=5, help="processes reading the biggest page in a loop")
    parser.add_argument("--tokens", type=int, default=500, help="chunks of the live stream")
    parser.add_argument("--token-interval", type=float, default=0.02, help="seconds between its chunks")
    parser.add_argument("--role", choices=("bench", "upstream"), default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "upstream":
        run_upstream(args.port, args.token_interval)
        return 0
    up_port, proxy_port, admin_port = free_port(), free_port(), free_port()
    upstream = subprocess.Popen([sys.executable, __file__, "--role", "upstream", "--port", str(up_port),
                                 "--token-interval", str(args.token_interval)])
    proxy = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--upstream", f"http://127.0.0.1:{up_port}",
         "--listen", f"127.0.0.1:{proxy_port}", "--admin-listen", f"127.0.0.1:{admin_port}",
         "--ring-size", str(args.ring_size), "--gpu-poll-interval", "0", "--upstream-metrics", "off",
         "--no-log-records", "--log-format", "json"],
        cwd=ROOT, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{proxy_port}/v1/chat/completions"
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        wait_for(up_port)
        wait_for(proxy_port)
        wait_for(admin_port)
        started = time.monotonic()
        asyncio.run(fill(url, args.ring_size))
        print(f"# ring filled with {args.ring_size:,} records in {time.monotonic() - started:.1f} s; live stream of "
              f"{args.tokens} chunks every {args.token_interval * 1000:g} ms; {args.scrapers} scraper processes "
              f"reading limit={MAX_PAGE} pages back to back")
        print(describe("stream alone", asyncio.run(live_gaps(url, args.tokens))))
        seconds = args.tokens * args.token_interval
        results: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
        scrapers = [multiprocessing.Process(target=run_scraper, args=(admin, seconds, results))
                    for _ in range(args.scrapers)]
        for scraper in scrapers:
            scraper.start()
        time.sleep(0.5)  # let every scraper be reading before the stream starts
        gaps = asyncio.run(live_gaps(url, args.tokens))
        pages = records = 0
        page_times: list[float] = []
        for _ in scrapers:
            got_pages, got_records, times = results.get(timeout=seconds + 60)
            pages, records, page_times = pages + got_pages, records + got_records, page_times + times
        for scraper in scrapers:
            scraper.join()
        print(describe(f"stream while {args.scrapers} scrape", gaps))
        if page_times:
            print(f"# {pages:,} pages ({records:,} records) read during the stream; one page took p50 "
                  f"{statistics.median(page_times) * 1000:.0f} ms, worst {max(page_times) * 1000:.0f} ms")
    finally:
        for process in (proxy, upstream):
            process.terminate()
            process.wait(timeout=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
