"""What the proxy costs, side by side with a direct connection and with nginx, in one run.

One run starts a fast upstream (its own process, streaming OpenAI chat-completion SSE), nginx
from Debian (`proxy_buffering off`, keep-alive HTTP/1.1 upstream), the proxy
(`python -m proxy serve`, optionally `--workers N`), and a load generator here. Where the
machine has two cores or more, the generator and the upstream share one core and each relay
(nginx, the proxy) gets the others to itself, so a relay that runs out of CPU shows as lost
throughput, not as a slower generator.

The hard case first: **unpaced**, tokens as fast as the upstream can write them, several events
per socket write (each its own HTTP chunk, as a server under load sends them), closed loop at each
level of concurrent streams, read by bare protocols that count the tokens in the raw bytes (as the
independent harness's generator does: aiohttp's client, parsing each chunk, set the pace at 8 chunks
per write, not the relay). It prints, per level:
tokens/s direct, through nginx and through the proxy; the CPU each relay spent per relayed
event (user + system time of all its processes over the events it carried); and the TTFT each
relay adds (p50, p99). Then **paced** (like a real server, `--token-interval`): the added TTFT
at the same levels, and the CPU per event at one event per write, the median of `--paced-rounds`
rounds with the relays in turn (its spread from run to run is wider than the unpaced one's), and
how much of it the kernel spent (the syscalls and the loopback's TCP work: the same for any relay,
so the part that tells relays apart is the rest). Then the idle TTFT of single requests, each target in turn.

    python benchmarks/overhead.py                       # the whole table
    python benchmarks/overhead.py --workers 2           # the proxy with two worker processes
    python benchmarks/overhead.py --targets direct,proxy,bare   # bare aiohttp: the stack's floor
    python benchmarks/overhead.py --targets direct,nginx,proxy,raw   # raw asyncio protocols: Python's floor
    python benchmarks/overhead.py --baseline ../before   # and an older checkout, side by side

Never run as a timed test: the figures depend on the machine, and docs/overhead.md quotes one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
# `proxy` runs as users run it: its defaults (the history on, a log line per record, the upstream's
# state polled); `nohist` is the same with `--history off`, beside it.
TARGETS = ("direct", "nginx", "proxy", "nohist", "bare", "raw")


# The independent harness (`../shared/bench/overhead/`), when it stands beside this checkout.
HARNESS = ROOT.parent / "shared" / "bench" / "overhead"


def harness_loadgen() -> Any:
    """The independent harness's load generator, its `loadgen` module; None where it is not here."""
    if not (HARNESS / "loadgen.py").exists():
        return None
    if str(HARNESS) not in sys.path:
        sys.path.insert(0, str(HARNESS))
    import loadgen  # type: ignore[import-not-found]

    return loadgen


def start_harness_upstream() -> tuple[subprocess.Popen[bytes], int]:
    """The independent harness's upstream on CPU 0, listening (its process and port)."""
    port = free_port()
    upstream = subprocess.Popen(["taskset", "-c", "0", sys.executable, str(HARNESS / "upstream.py"), "--port",
                                 str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    wait_for(port)
    return upstream, port


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- the upstream (runs in its own process) ------------------------------------------------
def sse(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chunk_of(delta: dict[str, str], finish: str | None = None) -> dict[str, object]:
    return {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1733000000, "model": "bench",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def stream_events(tokens: int) -> tuple[bytes, list[bytes], bytes]:
    """What vLLM sends with include_usage: a role chunk, one chunk per token, the finish chunk,
    the usage chunk and [DONE]: every stream holds events the fast path must hand to the parser."""
    role = sse(chunk_of({"role": "assistant", "content": ""}))
    body = [sse(chunk_of({"content": f"tok{i} "})) for i in range(tokens)]
    final = (sse(chunk_of({}, "length"))
             + sse({"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1733000000,
                    "model": "bench", "choices": [],
                    "usage": {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": tokens + 5}})
             + b"data: [DONE]\n\n")
    return role, body, final


EXTRA_EVENTS = 4  # role, finish, usage, [DONE]
WARM_UP = 1000  # short requests per relay before its fixed cost is measured
# The proxy makes and observes finished records in batches (at most `DELIVERY_BATCH_S`, 0.5 s): a
# round's CPU is read this long after its last answer, so that the records it made are counted with
# it (the relay is otherwise idle then). Read at once, a round would leave out its last batch: up to
# a tenth of its records' work in the paced rounds.
SETTLE_S = 0.7


class Steps:
    """A continuous-batching engine's steps, as vLLM's: every `interval` each running stream gets its next
    token, all in the same step (so a relay meets them in bursts, as it does in front of a real server)."""

    def __init__(self) -> None:
        self.waiting: list[asyncio.Future[None]] = []
        self.running = False
        self.task: asyncio.Task[None] | None = None

    async def next(self, interval: float) -> None:
        loop = asyncio.get_running_loop()
        step: asyncio.Future[None] = loop.create_future()
        self.waiting.append(step)
        if not self.running:
            self.running = True
            self.task = loop.create_task(self._run(interval))
        await step

    async def _run(self, interval: float) -> None:
        loop = asyncio.get_running_loop()
        at = loop.time()
        while self.waiting:
            at += interval
            await asyncio.sleep(max(0.0, at - loop.time()))
            due, self.waiting = self.waiting, []
            for step in due:
                step.set_result(None)
        self.running = False


def run_upstream(port: int, tokens: int, reuse_port: bool = False) -> None:
    """The upstream server (`reuse_port`: one of several processes on one port, as scaling.py runs it).
    Paced (`X-Bench-Interval`): the first token at once (TTFT measures the path, not the engine), the
    others at the engine's steps, shared by every running stream."""
    role, body, final = stream_events(tokens)
    framed = [b"%x\r\n%b\r\n" % (len(event), event) for event in body]
    framed_final = b"".join(b"%x\r\n%b\n\n\r\n" % (len(event) + 2, event) for event in final.split(b"\n\n")[:-1])
    steps = Steps()

    async def stream(request: web.Request) -> web.StreamResponse:
        asked = orjson.loads(await request.read()).get("max_tokens") or tokens
        interval = float(request.headers.get("X-Bench-Interval", "0"))
        batch = max(1, int(request.headers.get("X-Bench-Batch", "1")))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(role)
        events = body[:asked]
        if interval:
            for i, event in enumerate(events):
                if i:
                    await steps.next(interval)
                await response.write(event)
            await response.write(final)
        else:
            # As a server under load sends them, and as the independent harness does: each event its
            # own HTTP chunk, `batch` chunks in one socket write (framed here, so aiohttp's writer
            # passes them as they are and adds no chunk around them; the last chunk is ours too).
            request.writer.chunked = False
            for i in range(0, len(events), batch):
                await response.write(b"".join(framed[i:min(i + batch, len(events))]))
            await response.write(framed_final + b"0\r\n\r\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", stream)
    import uvloop

    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, backlog=4096 if reuse_port else 1024,
                reuse_port=reuse_port or None)


# --- nginx -----------------------------------------------------------------------------------
# The independent harness's settings (../shared/bench/overhead/overhead.sh), so that both measure
# the same nginx: keep-alive without a request limit on either side, every waiting accept at once.
NGINX_CONF = """worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; multi_accept on; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream llm {{ server 127.0.0.1:{upstream}; keepalive 256; keepalive_requests 1000000; }}
    server {{
        listen 127.0.0.1:{port} backlog=1024;
        keepalive_requests 1000000;
        keepalive_timeout 300s;
        location / {{
            proxy_pass http://llm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"""


# --- the load generator ----------------------------------------------------------------------
async def one_stream(session: aiohttp.ClientSession, url: str, max_tokens: int,
                     headers: dict[str, str]) -> tuple[float, int]:
    started = time.perf_counter()
    ttft = -1.0
    tokens = 0
    body = {"model": "bench", "stream": True, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "x"}],
            "stream_options": {"include_usage": True}}
    async with session.post(url, json=body, headers=headers) as response:
        async for chunk in response.content.iter_any():
            found = chunk.count(b'"content":"tok')
            if found and ttft < 0:
                ttft = time.perf_counter() - started
            tokens += found
    return ttft, tokens


TOKEN_MARK = b'"content":"tok'
LAST_CHUNK = b"\r\n0\r\n\r\n"


class RawStream(asyncio.Protocol):
    """One keep-alive connection of the unpaced load, on a bare protocol as the independent
    harness's generator is: the answer's bytes are not parsed, only its tokens counted (a mark
    split between two reads counted once) and its last chunk seen. aiohttp's client would parse
    each HTTP chunk in Python: at many chunks per read it, not the relay, sets the pace."""

    def __init__(self) -> None:
        self.transport: Any = None  # (uvloop's transports are not asyncio.Transport's subclasses)
        self.answer: asyncio.Future[tuple[float, int]] | None = None
        self.sent = 0.0
        self.ttft = -1.0
        self.tokens = 0
        self.tail = b""
        self.head_checked = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def ask(self, request: bytes) -> asyncio.Future[tuple[float, int]]:
        """Send one request; the future gets (TTFT, tokens) when its answer's last chunk came."""
        assert self.transport is not None
        self.answer = asyncio.get_running_loop().create_future()
        self.sent, self.ttft, self.tokens, self.tail, self.head_checked = time.perf_counter(), -1.0, 0, b"", False
        self.transport.write(request)
        return self.answer

    def data_received(self, data: bytes) -> None:
        answer = self.answer
        if answer is None or answer.done():
            return
        if not self.head_checked:
            self.head_checked = True
            if not data.startswith(b"HTTP/1.1 200 "):
                answer.set_exception(RuntimeError(f"the relay answered {data[:40]!r}"))
                return
        seen = self.tail + data
        found = seen.count(TOKEN_MARK)
        if found:
            if self.ttft < 0:
                self.ttft = time.perf_counter() - self.sent
            self.tokens += found
        self.tail = seen[-(len(TOKEN_MARK) - 1):]
        if seen.endswith(LAST_CHUNK):
            answer.set_result((self.ttft, self.tokens))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(ConnectionError("the relay closed the connection mid-answer"))


def raw_request(url: str, max_tokens: int, headers: dict[str, str]) -> bytes:
    """The unpaced load's request, as bytes (what aiohttp's client sent for it)."""
    parts = urlsplit(url)
    body = orjson.dumps({"model": "bench", "stream": True, "max_tokens": max_tokens,
                         "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}})
    fields = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return (f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{fields}\r\n").encode() + body


async def level(url: str, concurrency: int, rounds: int, max_tokens: int,
                headers: dict[str, str]) -> tuple[float, list[float], int]:
    """Closed loop: `concurrency` streams at once on keep-alive connections of bare protocols,
    `rounds` times; (tokens/s, TTFTs, streams)."""
    loop = asyncio.get_running_loop()
    parts = urlsplit(url)
    conns: list[RawStream] = []
    for _ in range(concurrency):
        transport, conn = await loop.create_connection(RawStream, parts.hostname, parts.port)
        conn.transport = transport  # (uvloop may tell `connection_made` a turn later)
        conns.append(conn)
    try:
        warm, request = raw_request(url, 1, headers), raw_request(url, max_tokens, headers)
        await asyncio.gather(*(conn.ask(warm) for conn in conns))
        ttfts: list[float] = []
        total = 0
        started = time.perf_counter()
        for _ in range(rounds):
            for ttft, tokens in await asyncio.gather(*(conn.ask(request) for conn in conns)):
                ttfts.append(ttft)
                total += tokens
        elapsed = time.perf_counter() - started
    finally:
        for conn in conns:
            if conn.transport is not None:
                conn.transport.close()
    return total / elapsed, ttfts, concurrency * (rounds + 1)


async def staggered(url: str, concurrency: int, per_slot: int, max_tokens: int, interval: float) -> list[float]:
    """A steady load of `concurrency` paced streams whose starts are spread over one stream's
    length (as on a busy server, not a burst); each slot sends `per_slot` in a row, each at a random
    phase of the engine's step. The TTFTs."""
    headers = {"X-Bench-Interval": str(interval)}
    length = max_tokens * interval
    ttfts: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(one_stream(session, url, 1, {}) for _ in range(concurrency)))  # warm the pools

        async def slot(index: int) -> None:
            await asyncio.sleep(index * length / concurrency)
            for _ in range(per_slot):
                ttft, _ = await one_stream(session, url, max_tokens, headers)
                ttfts.append(ttft)
                await asyncio.sleep(random.random() * interval)  # the next at a random phase of the step

        await asyncio.gather(*(slot(i) for i in range(concurrency)))
    return ttfts


async def short_requests(url: str, total: int, in_flight: int) -> None:
    """`total` short streams, `in_flight` at a time: what each request costs a relay, apart from its tokens."""
    left = iter(range(total))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def slot() -> None:
            for _ in left:
                await one_stream(session, url, 4, {})

        await asyncio.gather(*(slot() for _ in range(in_flight)))


async def idle_ttft(urls: dict[str, str], samples: int) -> dict[str, list[float]]:
    """TTFT of single requests to an otherwise idle server, each target in turn (so that a drift
    of the machine's speed hits all alike), each on a warm pooled connection."""
    out: dict[str, list[float]] = {name: [] for name in urls}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for url in urls.values():
            await one_stream(session, url, 1, {})
        names = list(urls)
        for i in range(samples):
            for name in names[i % len(names):] + names[:i % len(names)]:
                ttft, _ = await one_stream(session, urls[name], 1, {})
                out[name].append(ttft)
    return out


# --- processes and their CPU -----------------------------------------------------------------
def descendants(pid: int) -> list[int]:
    """pid and every process below it (a proxy's workers, nginx's worker)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        queue.extend(children.get(current, []))
    return found


def settled_cpu_seconds(pid: int) -> float:
    """`cpu_seconds` once the relay's work for what it has answered is done (SETTLE_S)."""
    time.sleep(SETTLE_S)
    return cpu_seconds(pid)


def cpu_seconds(pid: int) -> float:
    """CPU time of a process tree, from the scheduler's nanosecond clock of every thread
    (/proc/PID/task/TID/schedstat), not the 10 ms ticks of /proc/PID/stat."""
    total = 0
    for each in descendants(pid):
        try:
            tasks = list(Path(f"/proc/{each}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return total / 1e9


def cpu_ticks(pid: int) -> tuple[int, int]:
    """User and kernel CPU of a process tree in clock ticks (/proc/PID/stat's utime and stime): coarse,
    but the one place that says how much of a relay's CPU the kernel spent (its syscalls, and the
    loopback's TCP work done in them)."""
    user = kernel = 0
    for each in descendants(pid):
        try:
            fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
            user += int(fields[11])
            kernel += int(fields[12])
        except (OSError, ValueError, IndexError):
            continue
    return user, kernel


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def added_ms(direct: list[float], relayed: list[float]) -> tuple[float, float]:
    """The TTFT a relay adds, p50 and p99, in milliseconds."""
    return ((statistics.median(relayed) - statistics.median(direct)) * 1000,
            (percentile(relayed, 0.99) - percentile(direct, 0.99)) * 1000)


def stop_all(processes: list[subprocess.Popen[bytes]], how: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
    """Signal every process (`how`), then wait for each, killing what outlives `timeout_s`."""
    for process in processes:
        process.send_signal(how)
    for process in processes:
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()


def wait_for(port: int) -> None:
    for _ in range(400):
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise SystemExit(f"nothing listening on port {port}")


@dataclass
class Setup:
    """The processes of one run and where each is pinned."""

    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)
    closers: list[Callable[[], None]] = field(default_factory=list)  # servers started for the run (PostgreSQL)
    pinning: str = "none (fewer than 2 CPUs)"


def pin_plan(workers: int) -> tuple[set[int] | None, set[int] | None, str]:
    """(generator+upstream cores, relay cores, description), or Nones when there is one core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None, None, "none (one CPU)"
    load, relay = {cores[0]}, set(cores[1:1 + workers]) if len(cores) > workers else set(cores[1:])
    return load, relay, f"generator+upstream on CPU {cores[0]}, each relay on CPU {','.join(map(str, sorted(relay)))}"


def start(args: argparse.Namespace, tmp: Path) -> Setup:
    setup = Setup()
    load_cores, relay_cores, setup.pinning = pin_plan(args.workers)
    if load_cores is not None:
        os.sched_setaffinity(0, load_cores)  # the generator; the upstream inherits it

    def relay_pinned() -> None:
        if relay_cores is not None:
            os.sched_setaffinity(0, relay_cores)

    up_port = free_port()
    setup.processes["upstream"] = subprocess.Popen(
        [sys.executable, __file__, "--role", "upstream", "--port", str(up_port), "--tokens", str(args.tokens)])
    wait_for(up_port)
    setup.urls["direct"] = f"http://127.0.0.1:{up_port}/v1/chat/completions"
    if "nginx" in args.targets:
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        if not Path(nginx).exists():
            raise SystemExit("nginx is not installed (apt-get install -y nginx): drop it from --targets")
        port = free_port()
        conf = tmp / "nginx.conf"
        conf.write_text(NGINX_CONF.format(dir=tmp, upstream=up_port, port=port))
        setup.processes["nginx"] = subprocess.Popen([nginx, "-c", str(conf), "-p", str(tmp)],
                                                    preexec_fn=relay_pinned, stderr=subprocess.DEVNULL)
        wait_for(port)
        setup.urls["nginx"] = f"http://127.0.0.1:{port}/v1/chat/completions"
    common = ["--upstream", f"http://127.0.0.1:{up_port}", "--log-format", "json"]
    # The default history is a SQLite file in the user's state folder; here one of the run's own.
    proxy_only = ["--history", "off" if args.history_off else str(tmp / "history.sqlite3")]
    workers = ["--workers", str(args.workers)] if args.workers != 1 else []
    history_target = args.history_to
    if history_target == "postgres":  # a real PostgreSQL of its own, on the generator's cores
        sys.path.insert(0, str(ROOT))
        from tests.support.postgres import PASSWORD, PostgresServer

        server = PostgresServer()
        setup.closers.append(server.close)
        os.environ["PGPASSWORD"] = PASSWORD
        history_target = server.url(password=None)
        if load_cores is not None:
            postmaster = int((server.data / "postmaster.pid").read_text().split()[0])
            os.sched_setaffinity(postmaster, load_cores)  # its backends, forked later, inherit it
    for name, command in (("proxy", ["-m", "proxy", "serve", *workers, *proxy_only]),
                          ("nohist", ["-m", "proxy", "serve", *workers, "--history", "off"]),
                          ("history", ["-m", "proxy", "serve", *workers, "--history", history_target or "off"]),
                          ("baseline", ["-m", "proxy", "serve", "--history", str(tmp / "baseline.sqlite3")]),
                          ("bare", ["benchmarks/bare_passthrough.py"]),
                          ("raw", ["benchmarks/raw_passthrough.py"])):
        if name not in args.targets:
            continue
        port, admin = free_port(), free_port()
        setup.processes[name] = subprocess.Popen(
            [sys.executable, *command, *common, "--listen", f"127.0.0.1:{port}",
             "--admin-listen", f"127.0.0.1:{admin}"],
            cwd=args.baseline if name == "baseline" else ROOT, stdout=subprocess.DEVNULL, preexec_fn=relay_pinned)
        wait_for(port)
        setup.urls[name] = f"http://127.0.0.1:{port}/v1/chat/completions"
    return setup


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,8,64")
    parser.add_argument("--tokens", type=int, default=1000, help="tokens per unpaced stream")
    parser.add_argument("--batch", type=int, default=8, help="events per upstream socket write, unpaced")
    parser.add_argument("--rounds", type=int, default=3, help="closed-loop rounds per level")
    parser.add_argument("--token-interval", type=float, default=0.02, help="seconds between tokens, paced")
    parser.add_argument("--paced-tokens", type=int, default=50, help="tokens per paced stream")
    parser.add_argument("--paced-rounds", type=int, default=3,
                        help="paced rounds per level, the relays in turn (a drift of the machine hits all alike); "
                             "the median CPU per event is shown, and each round's")
    parser.add_argument("--requests", type=int, default=2000,
                        help="short requests (4 tokens) at 16 in flight, for each relay's CPU per request (0 = skip)")
    parser.add_argument("--ttft-samples", type=int, default=200,
                        help="single requests per target, in turn, for the idle TTFT (0 = skip)")
    parser.add_argument("--workers", type=int, default=1, help="the proxy's --workers")
    parser.add_argument("--history-off", action="store_true",
                        help="`proxy` without its history (by default it runs with its defaults: the history on)")
    parser.add_argument("--history-to", default=None, metavar="postgres|URL|PATH",
                        help="measure a second proxy, `history`, beside `proxy`, writing its records there: "
                             "`postgres` starts a real PostgreSQL for the run (tests/support/postgres.py)")
    parser.add_argument("--fixed-rounds", type=int, default=3,
                        help="rounds of --requests per relay for the fixed cost, after a warm-up; the median is shown")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout of this repository (git worktree add DIR REV): its proxy is measured "
                             "too, as `baseline`, with the same flags (less --history and --workers)")
    parser.add_argument("--targets", default="direct,nginx,proxy,nohist",
                        help=f"comma-separated, of {', '.join(TARGETS)} (direct is always measured)")
    parser.add_argument("--role", choices=("bench", "upstream"), default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "upstream":
        run_upstream(args.port, args.tokens)
        return 0
    args.targets = ["direct", *(t for t in args.targets.split(",") if t in TARGETS and t != "direct")]
    if args.baseline is not None:
        args.targets.append("baseline")
    if args.history_to is not None:
        args.targets.insert(args.targets.index("proxy") + 1 if "proxy" in args.targets else 1, "history")
    relays = args.targets[1:]
    with tempfile.TemporaryDirectory(prefix="llm-diag-bench-") as tmp:
        setup = start(args, Path(tmp))
        try:
            return report(args, setup, relays)
        finally:
            stop_all(list(setup.processes.values()))
            for close in setup.closers:
                close()


def history_note(history_to: str | None) -> str:
    if history_to is None:
        return ""
    where = "a PostgreSQL of its own (tests/support/postgres.py)" if history_to == "postgres" else "--history-to"
    return f"; `history`: the same proxy writing every record to {where}"


def report(args: argparse.Namespace, setup: Setup, relays: list[str]) -> int:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    levels = [int(x) for x in args.levels.split(",")]
    print(f"# {time.strftime('%Y-%m-%d')}: relay overhead, OpenAI chat-completion SSE; proxy --workers "
          f"{args.workers}, history {'off' if args.history_off else 'on (the defaults)'}"
          f"{'; nohist: the same with --history off' if 'nohist' in relays else ''}{history_note(args.history_to)}; "
          f"{os.cpu_count()} CPUs; pinning: {setup.pinning}")
    print(f"# unpaced: {args.tokens}-token streams, {args.batch} events per upstream write, {args.rounds} "
          f"closed-loop rounds per level, the relays' rounds in turn (the median round shown); "
          f"events per stream = tokens + {EXTRA_EVENTS} (role, finish, usage, DONE)")
    head = f"{'streams':>7} {'direct tok/s':>12}"
    for name in relays:
        head += f" {name + ' tok/s':>12} {'ratio':>6} {name + ' us/event':>15} {'+TTFT p50/p99 ms':>17}"
    print(head)
    unpaced = {"X-Bench-Batch": str(args.batch)}
    for concurrency in levels:
        rate, direct_ttft, _ = asyncio.run(level(setup.urls["direct"], concurrency, args.rounds, args.tokens, unpaced))
        line = f"{concurrency:>7} {rate:>12,.0f}"
        rates: dict[str, list[float]] = {name: [] for name in relays}
        costs: dict[str, list[float]] = {name: [] for name in relays}
        ttfts: dict[str, list[float]] = {name: [] for name in relays}
        for round_ in range(args.rounds):  # the relays in turn, as the paced rounds: a drift hits all alike
            for name in relays[round_ % len(relays):] + relays[:round_ % len(relays)]:
                before = cpu_seconds(setup.processes[name].pid)
                relayed, samples, streams = asyncio.run(level(setup.urls[name], concurrency, 1, args.tokens, unpaced))
                used = settled_cpu_seconds(setup.processes[name].pid) - before
                events = streams * EXTRA_EVENTS + concurrency * args.tokens + concurrency  # (the warm-up's 1 token)
                rates[name].append(relayed)
                costs[name].append(used / events * 1e6)
                ttfts[name] += samples
        for name in relays:
            p50, p99 = added_ms(direct_ttft, ttfts[name])
            relayed = statistics.median(rates[name])
            line += (f" {relayed:>12,.0f} {relayed / rate:>6.3f} {statistics.median(costs[name]):>15.2f}"
                     f" {f'{p50:.2f}/{p99:.2f}':>17}")
        print(line, flush=True)
        if args.rounds > 1:
            print(f"# {concurrency} unpaced streams, us/event per round: "
                  + "; ".join(f"{name} {' '.join(f'{c:.2f}' for c in costs[name])}" for name in relays), flush=True)
    print(f"# paced: {args.paced_rounds} round(s) of {args.paced_tokens}-token streams, one event every "
          f"{args.token_interval * 1000:g} ms in a write of its own (as vLLM, llama.cpp and Ollama send), starts "
          "spread over a stream's length, 4 streams per slot: the TTFT each relay adds under a steady load, and its "
          "CPU per relayed event (all of it: the requests' own cost shared over their events) and how busy its "
          "core was")
    print(f"{'streams':>7} {'direct TTFT p50/p99 ms':>23}"
          + "".join(f" {name + ' +p50/p99 ms':>20} {'us/event':>9} {'busy':>5}" for name in relays))
    for concurrency in levels if args.paced_rounds else ():
        direct_ttft = asyncio.run(staggered(setup.urls["direct"], concurrency, 4, args.paced_tokens,
                                            args.token_interval))
        line = (f"{concurrency:>7} "
                f"{f'{statistics.median(direct_ttft) * 1000:.2f}/{percentile(direct_ttft, 0.99) * 1000:.2f}':>23}")
        ttft_samples: dict[str, list[float]] = {name: [] for name in relays}
        per_event: dict[str, list[float]] = {name: [] for name in relays}
        busy: dict[str, list[float]] = {name: [] for name in relays}
        ticks: dict[str, list[int]] = {name: [0, 0] for name in relays}  # user, kernel: every round
        events = concurrency * (1 + EXTRA_EVENTS) + concurrency * 4 * (args.paced_tokens + EXTRA_EVENTS)
        for round_ in range(args.paced_rounds):  # the relays in turn, each round starting one further on
            for name in relays[round_ % len(relays):] + relays[:round_ % len(relays)]:
                pid = setup.processes[name].pid
                before, started, ticked = cpu_seconds(pid), time.perf_counter(), cpu_ticks(pid)
                ttft_samples[name] += asyncio.run(staggered(setup.urls[name], concurrency, 4, args.paced_tokens,
                                                            args.token_interval))
                elapsed = time.perf_counter() - started
                used = settled_cpu_seconds(pid) - before
                (user, kernel), (user_then, kernel_then) = cpu_ticks(pid), ticked
                ticks[name][0] += user - user_then
                ticks[name][1] += kernel - kernel_then
                per_event[name].append(used / events * 1e6)
                busy[name].append(used / elapsed)
        for name in relays:
            p50, p99 = added_ms(direct_ttft, ttft_samples[name])
            line += (f" {f'{p50:.2f}/{p99:.2f}':>20} {statistics.median(per_event[name]):>9.2f}"
                     f" {statistics.median(busy[name]):>5.0%}")
        print(line, flush=True)
        if args.paced_rounds > 1:
            print(f"# {concurrency} paced streams, us/event per round: "
                  + "; ".join(f"{name} {' '.join(f'{c:.1f}' for c in per_event[name])}" for name in relays), flush=True)
        parts = []
        for name in relays:
            user, kernel = ticks[name]
            if user + kernel:
                share = kernel / (user + kernel)
                whole = statistics.median(per_event[name])
                parts.append(f"{name} {share * whole:.1f} of {whole:.2f} us ({share:.0%})")
        print(f"# {concurrency} paced streams, the kernel's part of that CPU (stime over utime+stime in "
              "/proc/PID/stat, every round): " + ", ".join(parts), flush=True)
    if args.requests and args.fixed_rounds:
        for name in relays:
            asyncio.run(short_requests(setup.urls[name], WARM_UP, 16))  # its pool grown, its code paths warm
        costs: dict[str, list[float]] = {name: [] for name in relays}
        for _ in range(args.fixed_rounds):  # the relays' rounds interleaved: a drift of the machine hits all alike
            for name in relays:
                before = cpu_seconds(setup.processes[name].pid)
                asyncio.run(short_requests(setup.urls[name], args.requests, 16))
                costs[name].append((settled_cpu_seconds(setup.processes[name].pid) - before) / args.requests * 1e6)
        parts = [f"{name} {statistics.median(c):.0f} us ({min(c):.0f}-{max(c):.0f})" for name, c in costs.items()]
        print(f"# fixed cost: CPU per request, median of {args.fixed_rounds} rounds of {args.requests} 4-token "
              f"streams at 16 in flight after {WARM_UP} unmeasured, the relays' rounds in turn: " + ", ".join(parts))
    if args.ttft_samples:
        samples = asyncio.run(idle_ttft(setup.urls, args.ttft_samples))
        parts = [f"direct p50 {statistics.median(samples['direct']) * 1000:.2f} ms"]
        for name in relays:
            p50, p99 = added_ms(samples["direct"], samples[name])
            parts.append(f"{name} adds p50 {p50:.2f} ms, p99 {p99:.2f} ms")
        print(f"# idle TTFT, {args.ttft_samples} single requests per target in turn: " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
