"""Live traffic as a sweep: records grouped by model and budget band, the concurrency each saw
standing for the sweep's levels, and the sweep's verdict on each group. What `diagnose` prints
and `/api/diagnose` answers, from the same code.

This is observational, and it says so: live requests differ in prompt and in what they ask, and
the busy hours may differ from the quiet ones in more than concurrency, so a difference between
levels can have another cause. When a group shows an effect, the controlled sweep that would
settle it comes with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from proxy.record import ResponseRecord, concurrency_bucket
from proxy.sweep.sample import ClientMeasure, Sample
from proxy.sweep.stats import LevelSummary, by_level, summarize
from proxy.sweep.verdict import Verdict, decide

MIN_PER_LEVEL = 5
OBSERVATIONAL = ("observational: these are live requests, which differ in prompt and in what they ask, and busy "
                 "hours may differ from quiet ones in more than concurrency; a difference between levels can "
                 "have another cause (confounding)")


@dataclass
class Group:
    """The comparable records of one model and budget band, by the concurrency they saw."""

    model: str
    band: str
    samples: list[Sample]
    summaries: list[LevelSummary]
    verdict: Verdict

    def name(self) -> str:
        return f"model {self.model}, budget {self.band}"


def budget_band(budget: int | None) -> str:
    """`256-511` (a power-of-two band of requested_max_tokens), or `unset`."""
    if budget is None:
        return "unset"
    low = 1 << (max(1, budget).bit_length() - 1)
    return f"{low}-{2 * low - 1}"


def level_of(record: ResponseRecord) -> int:
    bucket = concurrency_bucket(record.concurrency_peak)
    return 128 if bucket == "128+" else int(bucket)


def groups_of(records: Sequence[ResponseRecord], *, model: str | None = None,
              min_per_level: int = MIN_PER_LEVEL) -> list[Group]:
    """The groups worth comparing: inference records, by model and budget band, levels with at least
    `min_per_level` records, at least two levels; the largest group first."""
    buckets: dict[tuple[str, str], list[ResponseRecord]] = {}
    for record in records:
        if record.outcome == "not_inference" or (model is not None and record.model != model):
            continue
        buckets.setdefault((record.model or "(none)", budget_band(record.requested_max_tokens)), []).append(record)
    found: list[Group] = []
    for (name, band), members in buckets.items():
        samples = [Sample(level_of(r), i, r.request_id, r, "proxy", ClientMeasure(status=r.status))
                   for i, r in enumerate(sorted(members, key=lambda r: r.started_at))]
        levels = {level: group for level, group in by_level(samples).items() if len(group) >= min_per_level}
        if len(levels) < 2:
            continue
        kept = [s for group in levels.values() for s in group]
        # Live levels interleave in time: a level's "wall time" is no throughput measure here.
        summaries = [replace(s, wall_s=None, output_tokens_per_s=None, requests_per_s=None)
                     for s in summarize(kept)]
        verdict = decide(summaries, by_level(kept))
        found.append(Group(name, band, kept, summaries, verdict))
    return sorted(found, key=lambda g: -len(g.samples))


def sweep_command(group: Group, target: str, admin: str) -> str:
    """The controlled sweep that would settle what the live records suggest."""
    budgets = sorted(r.record.requested_max_tokens for r in group.samples if r.record.requested_max_tokens)
    budget = budgets[len(budgets) // 2] if budgets else 256
    levels = ",".join(str(s.level) for s in group.summaries)
    return (f"llm-diag-proxy sweep --target {target} --admin {admin} --model {group.model} --max-tokens {budget} "
            f"--levels {levels} --repeats 5")


def explain(group: Group, target: str, admin: str) -> list[str]:
    """What the verdict of live traffic can and cannot say."""
    lines = [f"  ({OBSERVATIONAL})"]
    if group.verdict.kind in ("no_load_effect", "insufficient_data"):
        return lines
    lines.append("  To be sure it is the load, run the controlled sweep (the same request at each level):")
    lines.append(f"    {sweep_command(group, target, admin)}")
    return lines


def verdict_json(groups: Sequence[Group], *, since: float, records: int, source: str, min_per_level: int,
                 admin: str) -> dict[str, Any]:
    """The verdict of live traffic as `/api/diagnose` answers it."""
    return {
        "since": since, "records": records, "source": source, "observational": OBSERVATIONAL,
        "note": ("no model and budget band has records at two concurrency levels with "
                 f"{min_per_level} or more each yet"),
        "groups": [{"name": g.name(), "model": g.model, "band": g.band, "n": len(g.samples),
                    "levels": [{"level": s.level, "n": s.n, "completion_rate": s.completion_rate,
                                "output_tokens_median": s.output_tokens_median, "stop_counts": s.stop_counts}
                               for s in g.summaries],
                    "verdict": g.verdict.to_dict(),
                    "sweep": (None if g.verdict.kind in ("no_load_effect", "insufficient_data")
                              else sweep_command(g, "http://127.0.0.1:8080", admin))}
                   for g in groups]}
