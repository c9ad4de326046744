"""The fixed cost of one request, part by part, in process: what the record's making and export cost.

Builds the record of a short streamed answer the way the forwarding path does (Recorder: request
body, response head, a few chunks, finish with the classification), then hands it to each
observer the proxy runs (telemetry's enricher, metrics, the JSON log line, the record store), and
times each part over many requests. The relay itself (aiohttp's server and client) is measured
end to end by `benchmarks/overhead.py --requests`.

    python benchmarks/request_cost.py            # 20,000 requests per part

It also times the record of a streamed answer fed as the relay's lane feeds it (runs of reads in
their framing) at 2 and 50 tokens: what a record costs per answer and per event, in a loop (live,
between other work, it costs 2-4 times as much: docs/overhead.md, the fifth pass).
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.diagnosis.recorder import Recorder
from proxy.observers.logs import LogObserver, configure_logging
from proxy.observers.metrics import MetricsObserver, ProxyMetrics
from proxy.observers.record_store import RecordStore
from proxy.relay.in_flight import InFlightTracker

BODY = b'{"model":"m","stream":true,"max_tokens":16,"messages":[{"role":"user","content":"hi"}]}'
CHUNKS = [b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
          b'"delta":{"content":"t%d"},"logprobs":null,"finish_reason":null}]}\n\n' % i for i in range(4)]
FINAL = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
         b'"delta":{},"logprobs":null,"finish_reason":"stop","stop_reason":null}]}\n\n'
         b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[],'
         b'"usage":{"prompt_tokens":5,"completion_tokens":4,"total_tokens":9}}\n\ndata: [DONE]\n\n')


def record(i: int) -> Recorder:
    recorder = Recorder.start(f"req-{i}", "POST", "/v1/chat/completions", started=0.0)
    recorder.request_body(BODY)
    recorder.concurrency(1, 1, 1.0)
    recorder.response_head(200, "text/event-stream")
    for n, chunk in enumerate(CHUNKS):
        recorder.chunk(chunk, 0.01 * (n + 1))
    recorder.chunk(FINAL, 0.05)
    recorder.finish(0.06)
    return recorder


def streamed_record(i: int, tokens: int = 50) -> Recorder:
    """The record of a `tokens`-token answer as the relay's lane feeds it: each event one chunk of
    one read, handed over in runs of 16 inside its framing, then the record made in its steps."""
    recorder = Recorder.start(f"req-{i}", "POST", "/v1/chat/completions", started=0.0)
    recorder.request_body(BODY)
    recorder.response_head(200, "text/event-stream")
    sink, run, now = recorder.reads_sink, [], 0.0
    for read in STREAM_READS[:tokens] + STREAM_READS[-2:]:
        now += 0.02
        run.append((read, read.index(b"\r\n") + 2, len(read) - 2, now))
        if len(run) == 16:
            sink(run, sum(end - start for _, start, end, _ in run))
            run = []
    sink(run, sum(end - start for _, start, end, _ in run))
    recorder.concurrency(1, 1, 1.0)
    for _ in recorder.finish_steps(now):
        pass
    return recorder


def _framed(payload: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(payload), payload)


STREAM_READS = [_framed(b'data: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk","created":1,'
                        b'"model":"m","system_fingerprint":"fp","choices":[{"index":0,"delta":{'
                        + (b'"role":"assistant",' if n == 0 else b"") + b'"content":" w%d"},"logprobs":null,'
                        b'"finish_reason":null}]}\n\n' % n) for n in range(200)]
STREAM_READS += [_framed(b'data: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk","created":1,'
                         b'"model":"m","system_fingerprint":"fp","choices":[{"index":0,"delta":{},"logprobs":null,'
                         b'"finish_reason":"length"}]}\n\n'), _framed(b"data: [DONE]\n\n")]


def timed(name: str, n: int, work: Callable[[int], object]) -> float:
    started = time.process_time()
    for i in range(n):
        work(i)
    spent = (time.process_time() - started) / n * 1e6
    print(f"{name:<46} {spent:8.1f} us")
    return spent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=20_000)
    args = parser.parse_args()
    sink = io.TextIOWrapper(io.BytesIO())  # held here: the logger writes to it to the end
    configure_logging("info", "json", stream=sink)
    metrics = ProxyMetrics(max_models=64)
    observers: list[tuple[str, Callable[[object], None]]] = [
        ("metrics (MetricsObserver.on_response)", MetricsObserver(metrics).on_response),  # type: ignore[list-item]
        ("JSON log line (LogObserver.on_response)", LogObserver("http://127.0.0.1:8000").on_response),  # type: ignore[list-item]
        ("record store (RecordStore.on_response)", RecordStore(10_000).on_response),  # type: ignore[list-item]
    ]
    records = [record(i).record for i in range(args.n)]
    tracker = InFlightTracker()
    print(f"# {time.strftime('%Y-%m-%d')}: fixed work per request, in process, {args.n} requests per part")
    total = timed("record: parse 6 chunks, classify (Recorder)", args.n, record)
    for tokens in (2, 50):
        timed(f"  record of a {tokens}-token stream (not summed)", args.n // 4,
              lambda i, tokens=tokens: streamed_record(i, tokens))
    total += timed("concurrency tracking (admit + release)", args.n, lambda i: tracker.release(tracker.admit()))
    total += timed("record.to_dict()", args.n, lambda i: records[i].to_dict())
    for name, hook in observers:
        total += timed(name, args.n, lambda i, hook=hook: hook(records[i]))  # type: ignore[misc]
    print(f"{'sum':<46} {total:8.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
