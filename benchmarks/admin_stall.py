"""Does reading the admin API stall live traffic? The worst chunk gap of a live stream through the
proxy, with and without readers of the admin API.

Three processes besides this one: an upstream (fast JSON answers to fill the ring, and a stream
paced at --token-interval), the proxy (`python -m proxy serve`, ring --ring-size, a history of
--history-records written before it starts), and --scrapers processes that each read back to
back for as long as the stream lasts: the biggest page of /api/requests (following next_cursor,
starting over at the end) and, with --diagnose, `/api/diagnose` over the whole history in turn.
The stream is measured here, at the client: the gap between two chunks arriving, before and
during the reads.

    python benchmarks/admin_stall.py                       # 50,000 in the history, diagnose and pages
    python benchmarks/admin_stall.py --history-records 0 --no-diagnose   # the ring of 10,000 alone
    python benchmarks/admin_stall.py --scrapers 0          # the stream alone, twice
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.overhead import chunk_of, free_port, percentile, pin_plan, sse, wait_for  # noqa: E402

MAX_PAGE = 1000  # proxy.serve.admin.MAX_PAGE: the biggest page a client may ask for


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
            await response.write(sse(chunk_of({"content": f"tok{i} "})))
        await response.write(final)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# --- the scraper -------------------------------------------------------------------------------
def run_scraper(admin: str, seconds: float, diagnose: bool, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """Pages back to back and, with `diagnose`, /api/diagnose back to back beside them. Niced: they
    share a core with the upstream and the stream's client, whose timing is the measurement."""
    os.nice(10)
    async def pages(session: aiohttp.ClientSession, deadline: float) -> tuple[int, int, list[float], int]:
        count = records = busy = 0
        times: list[float] = []
        cursor: str | None = None
        while time.monotonic() < deadline:
            params = {"limit": str(MAX_PAGE), **({"cursor": cursor} if cursor else {})}
            started = time.perf_counter()
            async with session.get(f"{admin}/api/requests", params=params) as response:
                body = await response.read()
            if response.status == 503:
                busy += 1
                await asyncio.sleep(float(response.headers.get("Retry-After", "1")))
                continue
            page = orjson.loads(body)
            times.append(time.perf_counter() - started)
            count += 1
            records += len(page["records"])
            next_cursor = page.get("next_cursor")
            cursor = str(next_cursor) if next_cursor is not None else None
        return count, records, times, busy

    async def verdicts(session: aiohttp.ClientSession, deadline: float) -> tuple[list[float], int]:
        times: list[float] = []
        busy = 0
        while diagnose and time.monotonic() < deadline:
            started = time.perf_counter()
            async with session.get(f"{admin}/api/diagnose", params={"since": "86400"}) as response:
                await response.read()
            if response.status == 503:
                busy += 1
                await asyncio.sleep(float(response.headers.get("Retry-After", "1")))
            else:
                times.append(time.perf_counter() - started)
        return times, busy

    async def scrape() -> tuple[int, int, list[float], list[float], int]:
        deadline = time.monotonic() + seconds
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            (count, records, times, busy), (verdict_times, verdict_busy) = await asyncio.gather(
                pages(session, deadline), verdicts(session, deadline))
        return count, records, times, verdict_times, busy + verdict_busy

    out.put(asyncio.run(scrape()))


def fill_history(path: Path, count: int) -> None:
    """`count` records as the proxy writes them, spread over the last hour at levels 1 to 8 (so
    that diagnose has groups to compare), written by the proxy's own history writer."""
    from proxy.observers.history import History
    from proxy.record import ResponseRecord

    history = History(str(path), max_age_s=0, max_bytes=0)
    assert history.open()
    start = time.time() - 3600
    for i in range(count):
        level = (1, 2, 4, 8)[i % 4]
        output = 256 if level < 4 or i % 3 else 97
        history.on_response(ResponseRecord(
            request_id=f"{i:032x}", method="POST", path="/v1/chat/completions", route="/v1/chat/completions",
            dialect="openai", started_at=start + i * 3600 / count, model=f"model-{i % 3}", status=200,
            upstream_request_id=f"chatcmpl-{i:024x}", requested_max_tokens=256, stream=True,
            prompt_tokens=700 + i % 50, output_tokens=output, stop_reason="length" if output == 256 else "eos",
            length_cause="requested_budget" if output == 256 else None, concurrency_at_start=level,
            concurrency_peak=level, ttft_s=0.05 * level, duration_s=output * 0.02 * level, bytes_out=output * 180,
            itl_mean_s=0.02 * level, itl_p95_s=0.03 * level, itl_max_s=0.05 * level, temperature=0.7))
        if i % 10_000 == 9_999:
            time.sleep(0.3)  # the writer's queue holds 50,000; let it drain
    history.close(timeout_s=120)


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
    parser.add_argument("--scrapers", type=int, default=5, help="processes reading the admin API in a loop")
    parser.add_argument("--history-records", type=int, default=50_000,
                        help="records in the history before the proxy starts (0: no history, the ring only)")
    parser.add_argument("--no-diagnose", dest="diagnose", action="store_false",
                        help="read pages only, no /api/diagnose")
    parser.add_argument("--tokens", type=int, default=500, help="chunks of the live stream")
    parser.add_argument("--token-interval", type=float, default=0.02, help="seconds between its chunks")
    parser.add_argument("--role", choices=("bench", "upstream"), default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "upstream":
        run_upstream(args.port, args.token_interval)
        return 0
    up_port, proxy_port, admin_port = free_port(), free_port(), free_port()
    load_cores, relay_cores, pinning = pin_plan(1)
    if load_cores is not None:
        os.sched_setaffinity(0, load_cores)  # this client, the scrapers and the upstream inherit it

    def relay_pinned() -> None:
        if relay_cores is not None:
            os.sched_setaffinity(0, relay_cores)  # the proxy, and its niced admin readers

    scratch = Path(tempfile.mkdtemp(prefix="admin-stall-"))
    history = scratch / "history.sqlite3"
    if args.history_records:
        started = time.monotonic()
        fill_history(history, args.history_records)
        print(f"# history of {args.history_records:,} records written in {time.monotonic() - started:.1f} s "
              f"({history.stat().st_size / 2**20:.0f} MiB)")
    upstream = subprocess.Popen([sys.executable, __file__, "--role", "upstream", "--port", str(up_port),
                                 "--token-interval", str(args.token_interval)])
    proxy = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--upstream", f"http://127.0.0.1:{up_port}",
         "--listen", f"127.0.0.1:{proxy_port}", "--admin-listen", f"127.0.0.1:{admin_port}",
         "--ring-size", str(args.ring_size), "--gpu-poll-interval", "0", "--upstream-metrics", "off",
         "--no-log-records", "--log-format", "json",
         "--history", str(history) if args.history_records else "off"],
        cwd=ROOT, stdout=subprocess.DEVNULL, preexec_fn=relay_pinned)
    url = f"http://127.0.0.1:{proxy_port}/v1/chat/completions"
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        wait_for(up_port)
        wait_for(proxy_port)
        wait_for(admin_port)
        started = time.monotonic()
        asyncio.run(fill(url, args.ring_size))
        reads = f"limit={MAX_PAGE} pages" + (" and, beside them, /api/diagnose" if args.diagnose else "")
        print(f"# ring filled with {args.ring_size:,} records in {time.monotonic() - started:.1f} s; live stream of "
              f"{args.tokens} chunks every {args.token_interval * 1000:g} ms; {args.scrapers} scraper processes "
              f"reading {reads} back to back; pinning: {pinning}")
        print(describe("stream alone", asyncio.run(live_gaps(url, args.tokens))))
        seconds = args.tokens * args.token_interval
        results: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
        scrapers = [multiprocessing.Process(target=run_scraper, args=(admin, seconds, args.diagnose, results))
                    for _ in range(args.scrapers)]
        for scraper in scrapers:
            scraper.start()
        time.sleep(0.5)  # let every scraper be reading before the stream starts
        gaps = asyncio.run(live_gaps(url, args.tokens))
        pages = records = busy = 0
        page_times: list[float] = []
        verdict_times: list[float] = []
        for _ in scrapers:
            got_pages, got_records, times, verdicts, got_busy = results.get(timeout=seconds + 300)
            pages, records, page_times = pages + got_pages, records + got_records, page_times + times
            verdict_times, busy = verdict_times + verdicts, busy + got_busy
        for scraper in scrapers:
            scraper.join()
        print(describe(f"stream while {args.scrapers} scrape", gaps))
        if page_times:
            print(f"# {pages:,} pages ({records:,} records) read during the stream; one page took p50 "
                  f"{statistics.median(page_times) * 1000:.0f} ms, worst {max(page_times) * 1000:.0f} ms")
        if verdict_times:
            print(f"# {len(verdict_times)} /api/diagnose answered during the stream, each over "
                  f"{args.history_records or args.ring_size:,} records: p50 {statistics.median(verdict_times):.1f} s, "
                  f"worst {max(verdict_times):.1f} s")
        if busy:
            print(f"# {busy} reads answered 503 admin_busy (one read runs at a time, 8 wait)")
    finally:
        for process in (proxy, upstream):
            process.terminate()
            process.wait(timeout=10)
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
