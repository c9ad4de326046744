"""Pure statistics of a sweep: per-level summaries and the bootstrap interval of a difference.

No I/O and no clock: every function here is deterministic (the bootstrap takes a seed), so a
sweep's numbers can be recomputed from its `sweep.json`.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Any

from proxy.record import COMPLETE_STOP_REASONS, ResponseRecord
from proxy.sweep.sample import Sample

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 20240601
LARGE_SAMPLE = 500  # both groups at least this big: the normal interval, as good and 10,000x cheaper


def quantile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation between order statistics (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * min(max(q, 0.0), 1.0)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    value = ordered[low] + (ordered[high] - ordered[low]) * (position - low)
    return min(max(value, ordered[low]), ordered[high])  # rounding must not step outside the pair


def median(values: Sequence[float]) -> float | None:
    return quantile(values, 0.5)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


CONTEXT_ERRORS = frozenset({"context_exhausted", "exceeds_context"})


def stop_label(record: ResponseRecord) -> str:
    """The stop reason, with `length` split by its cause (`length:server_limit`,
    `length:requested_budget`, `length:unknown`) and a context error named
    (`upstream_error:context_exhausted`, `upstream_error:exceeds_context`); an answer to a prompt the
    server cut on the way in is `prompt_truncated` however it ended, one whose tool call or JSON is
    not whole though it said it ended is `answer_incomplete:tool_call` (or `:json`), and one never
    generated says why (`not_generated:no_user_turn`)."""
    if record.prompt_truncated:
        return "prompt_truncated"
    if record.cause in ("model_unloaded", "undelivered"):
        return record.cause
    if record.answer_complete is False and record.stop_reason in COMPLETE_STOP_REASONS:
        return f"answer_incomplete:{record.incomplete_part or 'tool_call'}"
    if record.stop_reason == "length" and record.length_cause is not None:
        return f"length:{record.length_cause}"
    if record.stop_reason == "upstream_error" and record.upstream_error in CONTEXT_ERRORS:
        return f"upstream_error:{record.upstream_error}"
    if record.stop_reason == "not_generated" and record.user_turn is False:
        return "not_generated:no_user_turn"
    return record.stop_reason


def is_complete(record: ResponseRecord) -> bool:
    """The answer ended on its own (EOS, a stop sequence, a tool call), to the whole prompt: one whose
    prompt the server cut answered another question, however complete it looks."""
    return (record.stop_reason in COMPLETE_STOP_REASONS and not record.prompt_truncated
            and record.answer_complete is not False)


def output_tokens(record: ResponseRecord) -> int:
    """Output tokens of a response; one that produced none (rejected, failed) counts as 0."""
    return record.output_tokens or 0


@dataclass(frozen=True, slots=True)
class Interval:
    """A point estimate with a two-sided confidence interval."""

    estimate: float
    low: float
    high: float
    confidence: float
    method: str

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def _variance(values: Sequence[float]) -> float:
    """The sample variance in floats (statistics.variance works in exact fractions: seconds for 50,000)."""
    mean = math.fsum(values) / len(values)
    return math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)


def bootstrap_mean_difference(a: Sequence[float], b: Sequence[float], *, confidence: float = 0.95,
                              resamples: int = BOOTSTRAP_RESAMPLES,
                              seed: int = BOOTSTRAP_SEED) -> Interval | None:
    """mean(b) - mean(a) with a percentile bootstrap interval (each group resampled on its own).

    Where both groups hold LARGE_SAMPLE or more, the mean difference is as normal as the bootstrap
    would find it (the central limit theorem at n >= 500, even for a two-valued figure such as
    output tokens that are the budget or far below it), and the interval is Welch's normal one:
    the bootstrap of 2,000 resamples costs 2,000 x n random draws, 25 s over 50,000 live records."""
    if not a or not b:
        return None
    estimate = sum(b) / len(b) - sum(a) / len(a)
    if min(len(a), len(b)) >= LARGE_SAMPLE:
        spread = math.sqrt(_variance(a) / len(a) + _variance(b) / len(b))
        z = NormalDist().inv_cdf(0.5 + confidence / 2)
        return Interval(estimate, estimate - z * spread, estimate + z * spread, confidence,
                        f"normal (Welch), {len(a)} and {len(b)} samples")
    rng = random.Random(seed)
    diffs = sorted(
        sum(rng.choices(b, k=len(b))) / len(b) - sum(rng.choices(a, k=len(a))) / len(a)
        for _ in range(resamples))
    tail = (1.0 - confidence) / 2
    low = quantile(diffs, tail)
    high = quantile(diffs, 1.0 - tail)
    assert low is not None and high is not None
    return Interval(estimate, low, high, confidence, f"percentile bootstrap, {resamples} resamples")


@dataclass(frozen=True, slots=True)
class LevelSummary:
    """What one concurrency level produced; None where no response carried the figure."""

    level: int
    n: int
    output_tokens_median: float
    output_tokens_q1: float
    output_tokens_q3: float
    output_tokens_mean: float
    requested_max_tokens: int | None
    tokens_counted: int  # responses whose token count is counted chunks, an estimate (no `usage`)
    complete: int
    completion_rate: float
    stop_counts: dict[str, int]
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    itl_p50_s: float | None
    itl_p95_s: float | None
    duration_p50_s: float
    duration_max_s: float
    deadline_hits: int
    client_disconnects: int
    preempted_responses: int | None  # of `preemptions_known` responses whose record carried the figure
    preemptions_known: int
    preemptions_max: float | None
    server_errors: int
    vram_free_min_bytes: int | None
    kv_cache_usage_max: float | None
    concurrency_mean: float | None
    joined: int
    reasoning_share_median: float | None = None  # of the budget, over responses whose share is known
    reasoning_heavy: int = 0  # length stops whose budget went mostly to reasoning
    wall_s: float | None = None  # the level's wall time: first request sent to last answer ended
    output_tokens_per_s: float | None = None  # all output tokens of the level over wall_s
    requests_per_s: float | None = None  # responses over wall_s
    latency_p50_s: float | None = None  # end to end, as the client saw it (send to last byte)
    latency_p95_s: float | None = None
    latency_p99_s: float | None = None
    completion_low: float | None = None  # 95% Wilson interval of completion_rate
    completion_high: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _present(values: Iterable[float | int | None]) -> list[float]:
    return [float(v) for v in values if v is not None]


def summarize_level(level: int, samples: Sequence[Sample]) -> LevelSummary:
    """The summary of one level's responses (at least one)."""
    if not samples:
        raise ValueError(f"no responses at concurrency {level}")
    records = [s.record for s in samples]
    tokens = [float(output_tokens(r)) for r in records]
    durations = [r.duration_s for r in records]
    ttfts = _present(r.ttft_s for r in records)
    itls = _present(r.itl_mean_s for r in records)
    budgets = Counter(r.requested_max_tokens for r in records if r.requested_max_tokens is not None)
    preemptions = _present(r.preemptions_during for r in records)
    vram = [r.vram_free_min_bytes for r in records if r.vram_free_min_bytes is not None]
    kv = _present(r.kv_cache_usage_max for r in records)
    shares = _present(r.reasoning_share for r in records)
    joined = [s for s in samples if s.record_source == "proxy"]
    complete = sum(1 for r in records if is_complete(r))
    latencies = [latency(s) for s in samples]
    wall = wall_time(samples)
    return LevelSummary(
        level=level,
        n=len(records),
        output_tokens_median=_must(median(tokens)),
        output_tokens_q1=_must(quantile(tokens, 0.25)),
        output_tokens_q3=_must(quantile(tokens, 0.75)),
        output_tokens_mean=_must(mean(tokens)),
        requested_max_tokens=budgets.most_common(1)[0][0] if budgets else None,
        tokens_counted=sum(1 for r in records if r.tokens_source == "counted" and (r.output_tokens or 0) > 0),
        complete=complete,
        completion_rate=complete / len(records),
        stop_counts=dict(Counter(stop_label(r) for r in records).most_common()),
        ttft_p50_s=quantile(ttfts, 0.5),
        ttft_p95_s=quantile(ttfts, 0.95),
        itl_p50_s=quantile(itls, 0.5),
        itl_p95_s=quantile(itls, 0.95),
        duration_p50_s=_must(median(durations)),
        duration_max_s=max(durations),
        deadline_hits=sum(1 for r in records if r.deadline_hit != "none"),
        client_disconnects=sum(1 for r in records if r.client_disconnected),
        preempted_responses=sum(1 for p in preemptions if p > 0) if preemptions else None,
        preemptions_max=max(preemptions) if preemptions else None,
        preemptions_known=len(preemptions),
        server_errors=sum(1 for r in records
                          if r.upstream_error is not None or (r.status is not None and r.status >= 500)),
        vram_free_min_bytes=min(vram) if vram else None,
        kv_cache_usage_max=max(kv) if kv else None,
        concurrency_mean=mean([s.record.concurrency_mean for s in joined]) if joined else None,
        joined=len(joined),
        reasoning_share_median=median(shares) if any(shares) else None,
        reasoning_heavy=sum(1 for r in records if r.budget_mostly_reasoning),
        wall_s=wall,
        output_tokens_per_s=sum(tokens) / wall if wall else None,
        requests_per_s=len(records) / wall if wall else None,
        latency_p50_s=quantile(latencies, 0.5),
        latency_p95_s=quantile(latencies, 0.95),
        latency_p99_s=quantile(latencies, 0.99),
        completion_low=wilson(complete, len(records))[0],
        completion_high=wilson(complete, len(records))[1],
    )


def wilson(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion (sound at 0 and n, unlike the normal one)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def latency(sample: Sample) -> float:
    """End-to-end latency of one response: the client's own clock where it measured one, else
    the record's (a record rebuilt from history has no client)."""
    return sample.client.duration_s if sample.client.duration_s > 0 else sample.record.duration_s


def wall_time(samples: Sequence[Sample]) -> float | None:
    """From the first request sent to the last answer ended: on the client's clock where the
    sweep measured it, else on the records' (started_at + duration_s); None when zero."""
    measured = [s for s in samples if s.client.duration_s > 0]
    if measured:
        wall = (max(s.client.sent_s + s.client.duration_s for s in measured)
                - min(s.client.sent_s for s in measured))
    else:
        wall = (max(s.record.started_at + s.record.duration_s for s in samples)
                - min(s.record.started_at for s in samples))
    return wall if wall > 0 else None


def summarize(samples: Iterable[Sample]) -> list[LevelSummary]:
    """One summary per concurrency level, lowest level first."""
    return [summarize_level(level, group) for level, group in by_level(samples).items()]


def by_level(samples: Iterable[Sample]) -> dict[int, list[Sample]]:
    """Samples grouped by level, lowest level first."""
    groups: dict[int, list[Sample]] = {}
    for sample in sorted(samples, key=lambda s: (s.level, s.index)):
        groups.setdefault(sample.level, []).append(sample)
    return groups


def _must(value: float | None) -> float:
    assert value is not None  # callers pass non-empty sequences
    return value
