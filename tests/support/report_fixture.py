"""A finished sweep built from records (a hidden cap from concurrency 4), for the report's tests."""

from __future__ import annotations

from proxy.sweep.report import render
from proxy.sweep.sample import Sample
from proxy.sweep.stats import by_level, summarize
from proxy.sweep.verdict import decide
from tests.support.sweep_samples import sample


def capped_samples() -> list[Sample]:
    return ([sample(1, i, tokens=120, duration=1.2 + 0.01 * i) for i in range(4)]
            + [sample(2, i, tokens=120, duration=1.8 + 0.01 * i) for i in range(8)]
            + [sample(4, i, tokens=60 + i, duration=2.0 + 0.01 * (i % 3)) for i in range(16)]
            + [sample(8, i, tokens=30 + i % 5, duration=2.0 - 0.01 * (i % 2)) for i in range(31)]
            + [sample(8, 31, tokens=None, stop="rejected", status=503, duration=0.01)])


def capped_report() -> str:
    samples = capped_samples()
    summaries = summarize(samples)
    verdict = decide(summaries, by_level(samples))
    run = {"date": "2026-12-03T10:00:00+00:00", "tool": "llm-diag-proxy", "version": "0.1.0",
           "target": "http://127.0.0.1:8080", "model": "qwen3:8b", "dialect": "openai", "server_type": "vLLM"}
    return render(summaries, by_level(samples), verdict,
                  {"target": "http://127.0.0.1:8080", "levels": "1,2,4,8", "run": run})
