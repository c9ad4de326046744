"""How fast one proxy's history writer stores records, and what a record takes on disk.

Runs the proxy's own writer (proxy.observers.history.History: the buffer, the writer thread, its
batches) against a real PostgreSQL that it starts itself (initdb and pg_ctl in a temporary
directory, as the tests do; as the `postgres` user when run as root) and against the embedded
SQLite file, side by side in one run. Each round hands the writer N typical records of a chat
completion (every field a real one fills: tokens, timings, the server's figures, telemetry) as
fast as the event loop would, and times until the last is committed.

    python benchmarks/history.py                  # 50,000 records per backend, 3 rounds
    python benchmarks/history.py --records 200000 --url postgresql://user@host/db   # your own server

Prints records/s per backend (the median round), what `on_response` costs the caller (the event
loop) per record, what the record's compact dict costs (made once per record, for the log line and
the row alike), and the bytes per record on disk (the table with its indexes, PostgreSQL's TOAST
included; the SQLite file and its WAL), which docs/history.md turns into a sizing rule.
Never run as a timed test: the figures depend on the machine and the disk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.observers.history import History
from proxy.record import CompactOnce, ResponseRecord


def typical(n: int, now: float) -> ResponseRecord:
    """A streamed chat completion as the proxy records it in front of vLLM with telemetry on."""
    return ResponseRecord(
        request_id=f"req-{n:012d}", method="POST", path="/v1/chat/completions", route="/v1/chat/completions",
        dialect="openai", started_at=now + n * 1e-4, instance="gpu-node-07:8080", upstream="http://127.0.0.1:8000",
        model="Qwen/Qwen2.5-7B-Instruct", stream=True, status=200, requested_max_tokens=512,
        output_tokens=187 + n % 300, tokens_source="usage", prompt_tokens=412, reasoning_tokens=0,
        visible_tokens=187 + n % 300, stop_reason="eos" if n % 7 else "length", finish_reason_raw="stop",
        length_cause=None if n % 7 else "requested_budget", length_cause_source=None if n % 7 else "output_count",
        prompt_tokens_source="usage", concurrency_at_start=5, concurrency_peak=8, concurrency_mean=6.4,
        queue_time_s=0.012, queue_time_source="vllm", ttft_s=0.081, itl_mean_s=0.021, itl_p95_s=0.034,
        itl_max_s=0.09, duration_s=4.2, bytes_out=41_230, seed=None, temperature=0.7,
        upstream_request_id=f"chatcmpl-{n:016x}", trace_id=f"{n:032x}", parent_span_id=f"{n:016x}",
        server_timings={"prompt_ms": 38.2, "predicted_ms": 4101.0, "predicted_per_second": 45.6},
        gpu="NVIDIA H100 80GB HBM3", vram_free_min_bytes=3_221_225_472, vram_used_max_bytes=81_000_000_000,
        upstream_running_max=8.0, upstream_waiting_max=2.0, kv_cache_usage_max=0.83, preemptions_during=0.0,
        preemptions_scope="server")


def rounds_of(history: History, records: int, rounds: int) -> tuple[list[float], list[float], list[float]]:
    """Records/s of each round (hand `records` to the writer, in bursts of 1,000 as a loop hands
    them over between other work, and wait until all are committed), the caller's µs per record
    in `on_response`, and in the record's compact dict. The records are handed over as the delivery
    does: the compact dict is made once per record, for the log line and the history's row alike,
    so it is timed apart (with `--log-records off` the history alone pays it)."""
    rates, costs, dicts = [], [], []
    compact_once = history._compact
    clock = time.perf_counter_ns
    for number in range(rounds):
        batch = [typical(number * records + n, time.time()) for n in range(records)]
        before = history.written
        started = time.perf_counter()
        handed = made = 0
        for chunk in range(0, records, 1000):
            for record in batch[chunk:chunk + 1000]:
                compact_once.delivering(record)
                t0 = clock()
                compact_once.compact(record)
                t1 = clock()
                history.on_response(record)
                handed += clock() - t1
                made += t1 - t0
            compact_once.delivering(None)
            time.sleep(0.001)
        while history.written - before < records:
            if history.dropped:
                raise SystemExit(f"the writer dropped {history.dropped} records")
            time.sleep(0.005)
        rates.append(records / (time.perf_counter() - started))
        costs.append(handed / records / 1e3)
        dicts.append(made / records / 1e3)
    return rates, costs, dicts


def measure(target: str, records: int, rounds: int,
            password: str | None = None) -> tuple[float, float, float, float, int]:
    """(median records/s, µs per on_response, µs per compact dict, bytes per record, rows) for one target."""
    history = History(target, max_age_s=0, max_bytes=0, password=password, buffer=records + 10, compact=CompactOnce())
    if not history.open():
        raise SystemExit(f"cannot open the history at {history.shown}")
    try:
        rates, costs, dicts = rounds_of(history, records, rounds)
    finally:
        history.close(60)
    if target.startswith("postgres"):
        import psycopg

        with psycopg.connect(target, password=password, autocommit=True) as connection:
            connection.execute("VACUUM ANALYZE llm_diag_records")
    rows = history.count()
    return (statistics.median(rates), statistics.median(costs), statistics.median(dicts),
            history.size_bytes() / max(rows, 1), rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=50_000, help="records per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--url", default=None, help="a PostgreSQL to write to (default: one started here)")
    args = parser.parse_args()
    server = None
    url = args.url
    password = None
    if url is None:
        from tests.support.postgres import PASSWORD, PostgresServer

        server = PostgresServer()
        url, password = server.url(password=None), PASSWORD
    try:
        with tempfile.TemporaryDirectory() as directory:
            results = {
                "postgresql": measure(url, args.records, args.rounds, password),
                "sqlite": measure(os.path.join(directory, "history.sqlite3"), args.records, args.rounds),
            }
    finally:
        if server is not None:
            server.close()
    print(f"# {time.strftime('%Y-%m-%d')}: the history writer, {args.records} typical records per round, "
          f"{args.rounds} rounds, median round; {os.cpu_count()} CPUs")
    print(f"{'backend':<11} {'records/s':>10} {'on_response us':>15} {'compact dict us':>16} {'bytes/record':>13} "
          f"{'rows':>8}")
    for name, (rate, cost, made, per_record, rows) in results.items():
        print(f"{name:<11} {rate:>10,.0f} {cost:>15.1f} {made:>16.1f} {per_record:>13,.0f} {rows:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
