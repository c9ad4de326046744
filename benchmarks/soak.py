"""The long soak: N concurrent streams through a proxy to the simulator for a while, mixed
dialects and faults, then what was left behind (records, in-flight, tasks, RSS, descriptors).

    python benchmarks/soak.py --streams 1000 --duration 300

Runs the code of tests/e2e/load/test_soak.py with long settings; every loop is bounded by
--duration (and --max-requests-per-worker) and ends by itself. Loopback only. Exit code 1
when a check fails, so it can gate a nightly job.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.load.soak import SoakReport, SoakSettings, run_soak

RSS_GROWTH_LIMIT_MIB = 64.0
FD_MARGIN = 8


def problems(report: SoakReport) -> list[str]:
    """The checks of the CI soak, as one line each."""
    found = []
    if report.missing or report.duplicates:
        found.append(f"{len(report.missing)} requests without a record, {len(report.duplicates)} with two")
    if report.wrong:
        found.append(f"{len(report.wrong)} records with an unexpected diagnosis")
    if report.client_errors:
        found.append(f"{len(report.client_errors)} client-side errors")
    if report.server_errors:
        found.append(f"{len(report.server_errors)} errors logged by the proxy's HTTP server")
    if report.in_flight_after != 0 or report.in_flight_gauge_after != 0:
        found.append(f"in flight after the run: {report.in_flight_after} (gauge {report.in_flight_gauge_after})")
    if report.pending_tasks_after:
        found.append(f"{len(report.pending_tasks_after)} tasks still pending")
    if report.rss_after_mib - report.rss_before_mib > RSS_GROWTH_LIMIT_MIB:
        found.append(f"RSS grew {report.rss_after_mib - report.rss_before_mib:.1f} MiB")
    if report.fds_free_after > report.fds_free_before + FD_MARGIN:
        found.append(f"descriptors off the upstream pool grew {report.fds_free_before} -> {report.fds_free_after}")
    if report.fds_after is not None and report.fds_after.touching.get(report.proxy_port, 0):
        found.append("client-side sockets still open after the run")
    if report.store_len > report.settings.ring_size:
        found.append(f"the ring holds {report.store_len} > {report.settings.ring_size}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=1000, help="concurrent workers (default %(default)s)")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of the measured phase")
    parser.add_argument("--max-requests-per-worker", type=int, default=100_000,
                        help="upper bound of requests per worker (default %(default)s)")
    parser.add_argument("--tokens", type=int, default=8, help="mean natural answer length in tokens")
    parser.add_argument("--token-time", type=float, default=0.4, help="seconds per simulated token")
    parser.add_argument("--ring-size", type=int, default=10_000, help="the proxy's record ring (default 10000)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.streams < 1 or args.duration <= 0 or args.max_requests_per_worker < 1:
        print("soak: error: --streams, --duration and --max-requests-per-worker must be positive", file=sys.stderr)
        return 2
    settings = SoakSettings(streams=args.streams, requests_per_worker=args.max_requests_per_worker,
                            duration_s=args.duration, tokens=args.tokens, token_time_s=args.token_time,
                            ring_size=args.ring_size, seed=args.seed)
    started = time.monotonic()
    report = asyncio.run(run_soak(settings))
    print("\n".join(report.lines()))
    print(f"wall time {time.monotonic() - started:.0f} s")
    found = problems(report)
    for line in found:
        print(f"soak: FAIL: {line}", file=sys.stderr)
    if args.json is not None:
        figures = asdict(report)
        figures["problems"] = found
        args.json.write_text(json.dumps(figures, indent=2, default=str))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
