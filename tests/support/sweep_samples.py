"""Records built for the sweep's pure tests: one Sample per response, with only what a rule reads."""

from __future__ import annotations

from typing import Any

from proxy.record import ResponseRecord
from proxy.sweep.sample import ClientMeasure, Sample


def sample(level: int, index: int = 0, *, tokens: int | None = 100, stop: str = "eos",
           duration: float = 1.0, budget: int = 200, status: int = 200, **fields: Any) -> Sample:
    record = ResponseRecord(
        request_id=f"r-{level}-{index}", method="POST", path="/v1/chat/completions",
        route="/v1/chat/completions", dialect="openai", started_at=0.0, status=status,
        requested_max_tokens=budget, output_tokens=tokens, stop_reason=stop,  # type: ignore[arg-type]
        duration_s=duration, ttft_s=0.05 * level, itl_mean_s=0.01 * level, **fields)
    return Sample(level, index, record.request_id, record, "proxy", ClientMeasure(status=status))


def level(level: int, n: int, **fields: Any) -> list[Sample]:
    """n alike samples at one level (index 0..n-1)."""
    return [sample(level, i, **fields) for i in range(n)]
