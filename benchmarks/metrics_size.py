"""How big /metrics gets at the model cap: bytes, lines and render time, per model.

Series are created when traffic needs them (only a model's `llm_proxy_truncated_total{cause=
"server_limit"}` exists at 0 from its first answer, for its alert), so the size follows the
traffic. Two shapes of traffic, each over --models models (the default cap is 50):

- one answer per model (a gateway that lists many models, each used now and then);
- a busy model: answers at three concurrency buckets, each complete, at the budget and cut.

    python benchmarks/metrics_size.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.observers.metrics import MetricsObserver, ProxyMetrics
from proxy.record import ResponseRecord

SHAPES = {
    "one answer per model": [(1, "eos", None)],
    "busy: 3 buckets x complete/budget/cut": [(peak, stop, cause) for peak in (1, 4, 8)
                                              for stop, cause in (("eos", None), ("length", "requested_budget"),
                                                                  ("length", "server_limit"))],
}


def record(model: str, n: int, peak: int, stop: str, length_cause: str | None) -> ResponseRecord:
    return ResponseRecord(
        request_id=f"{model}-{n:06d}-0123456789abcdef", method="POST", path="/v1/chat/completions",
        route="/v1/chat/completions", dialect="openai", started_at=time.time(), model=model, stream=True,
        requested_max_tokens=256, stop_reason=stop, length_cause=length_cause,  # type: ignore[arg-type]
        concurrency_at_start=peak, concurrency_peak=peak, output_tokens=180, ttft_s=0.21, itl_mean_s=0.02,
        duration_s=3.7, status=200)


def measure(models: int, shape: list[tuple[int, str, str | None]]) -> tuple[int, int, int, float]:
    metrics = ProxyMetrics(max_models=models)
    observer = MetricsObserver(metrics)
    n = 0
    for m in range(models):
        name = f"org/model-{m:02d}-instruct"
        for peak, stop, cause in shape:
            for _ in range(3):
                n += 1
                observer.on_response(record(name, n, peak, stop, cause))
    started = time.perf_counter()
    text = generate_latest(metrics.registry)
    took = time.perf_counter() - started
    return len(text), text.count(b"\n"), len(generate_openmetrics(metrics.registry)), took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=50, help="models (default: the cap, %(default)s)")
    args = parser.parse_args()
    base_bytes, base_lines, _, _ = measure(0, [])
    print(f"# /metrics with no traffic: {base_bytes:,} bytes, {base_lines} lines")
    print(f"{'traffic':<40} {'models':>6} {'bytes':>9} {'lines':>6} {'per model':>10} {'OpenMetrics':>12} "
          f"{'render ms':>9}")
    for name, shape in SHAPES.items():
        size, lines, openmetrics, took = measure(args.models, shape)
        print(f"{name:<40} {args.models:>6} {size:>9,} {lines:>6,} {(size - base_bytes) / args.models:>9,.0f}B "
              f"{openmetrics:>12,} {took * 1000:>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
