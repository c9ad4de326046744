"""Live traffic as a sweep: records grouped by model and budget band, the concurrency each saw
standing for the sweep's levels, and the sweep's verdict on each group. What `diagnose` prints
and `/api/diagnose` answers, from the same code.

This is observational, and it says so: live requests differ in prompt and in what they ask, and
the busy hours may differ from the quiet ones in more than concurrency, so a difference between
levels can have another cause. When a group shows an effect, the controlled sweep that would
settle it comes with it.
"""

from __future__ import annotations

import shlex
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from proxy.record import ResponseRecord, concurrency_bucket
from proxy.servers.base import ServerInfo
from proxy.sweep.sample import ClientMeasure, Sample
from proxy.sweep.stats import LevelSummary, by_level, summarize
from proxy.sweep.verdict import Verdict, decide
from proxy.sweep.whose import NO_KEY
from proxy.wire.dialects import sweep_dialect_of

MIN_PER_LEVEL = 5
OBSERVATIONAL = ("observational: these are live requests, which differ in prompt and in what they ask, and busy "
                 "hours may differ from quiet ones in more than concurrency; a difference between levels can "
                 "have another cause (confounding)")


BY = ("instance", "upstream", "client", "model")  # what `diagnose --by` compares
NO_EFFECT = ("no_load_effect", "insufficient_data")
RECORDS_SOURCE = "the proxy's records (context_tokens)"

@dataclass
class Group:
    """The comparable records of one model and budget band (and, with `--by`, of one proxy or
    server), by the concurrency they saw."""

    model: str
    band: str
    samples: list[Sample]
    summaries: list[LevelSummary]
    verdict: Verdict
    scope: tuple[str, str] | None = None  # ("instance", its name) or ("upstream", its URL) with --by
    thin_levels: tuple[tuple[int, int], ...] = ()  # (level, records) left out: fewer than min_per_level

    def name(self) -> str:
        where = f"{self.scope[0]} {self.scope[1]}, " if self.scope is not None else ""
        return f"{where}model {self.model}, budget {self.band}"


def scope_of(record: ResponseRecord, by: str | None) -> str | None:
    """The value `--by` groups a record under (None without --by)."""
    if by is None:
        return None
    value = {"model": record.model, "instance": record.instance, "upstream": record.upstream,
             "client": record.client}[by]
    return value or (NO_KEY if by == "client" else "(none)")


def context_of_records(records: Sequence[ResponseRecord]) -> ServerInfo | None:
    """The context one request got, as the records say it (`context_tokens`: the server's word, or
    the request's own num_ctx), when most of them agree on one number."""
    found = Counter(r.context_tokens for r in records if r.context_tokens)
    if not found:
        return None
    context, count = found.most_common(1)[0]
    return ServerInfo(RECORDS_SOURCE, context) if count * 2 > len(records) else None


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
              min_per_level: int = MIN_PER_LEVEL, by: str | None = None) -> list[Group]:
    """The groups worth comparing: inference records, by model and budget band (and by instance or
    upstream with `by`), levels with at least `min_per_level` records, at least two levels; the
    largest group first."""
    buckets: dict[tuple[str | None, str, str], list[ResponseRecord]] = {}
    for record in records:
        if record.outcome == "not_inference" or (model is not None and record.model != model):
            continue
        scope = scope_of(record, by) if by != "model" else None
        key = (scope, record.model or "(none)", budget_band(record.requested_max_tokens))
        buckets.setdefault(key, []).append(record)
    found: list[Group] = []
    for (scope, name, band), members in buckets.items():
        samples = [Sample(level_of(r), i, r.request_id, r, "proxy", ClientMeasure(status=r.status))
                   for i, r in enumerate(sorted(members, key=lambda r: r.started_at))]
        every = by_level(samples)
        levels = {level: group for level, group in every.items() if len(group) >= min_per_level}
        if len(levels) < 2:
            continue
        thin = tuple((level, len(group)) for level, group in sorted(every.items()) if level not in levels)
        kept = [s for group in levels.values() for s in group]
        # Live levels interleave in time: a level's "wall time" is no throughput measure here.
        summaries = [replace(s, wall_s=None, output_tokens_per_s=None, requests_per_s=None)
                     for s in summarize(kept)]
        verdict = decide(summaries, by_level(kept), server=context_of_records([s.record for s in kept]))
        found.append(Group(name, band, kept, summaries, verdict, (by, scope) if by and scope is not None else None,
                           thin))
    return sorted(found, key=lambda g: -len(g.samples))


def compare(groups: Sequence[Group], by: str, records: Sequence[ResponseRecord] = ()) -> list[str]:
    """The comparison `diagnose --by` ends with: which instances (upstreams, models) show a load
    effect and which do not, the one that differs named, e.g. `instance b:8080: serving_defect,
    server_limit from concurrency 4; the other 2: no load effect`."""
    verdicts: dict[str, list[Verdict]] = {}
    for group in groups:
        name = group.model if by == "model" else group.scope[1] if group.scope is not None else "(none)"
        verdicts.setdefault(name, []).append(group.verdict)
    effects = {name: next(v for v in found if v.kind not in NO_EFFECT)
               for name, found in sorted(verdicts.items()) if any(v.kind not in NO_EFFECT for v in found)}
    calm = sorted(name for name, found in verdicts.items()
                  if name not in effects and any(v.kind == "no_load_effect" for v in found))
    seen = {scope for r in records if r.outcome != "not_inference" and (scope := scope_of(r, by)) is not None}
    unjudged = sorted((seen | set(verdicts)) - set(effects) - set(calm))
    head = f"COMPARISON (by {by}): "
    tail = f"; {len(unjudged)} more with too few records to compare ({', '.join(unjudged[:5])})" if unjudged else ""
    if not effects:
        compared = f"{len(calm)} compared" if calm else "none had records at two concurrency levels"
        return [f"{head}no {by} shows a load effect ({compared}){tail}"]
    named = "; ".join(f"{by} {name}: {_effect(verdict)}" for name, verdict in effects.items())
    if not calm:
        return [f"{head}every {by} shows it: {named}{tail}"]
    others = f"the other {len(calm)}" if len(calm) > 1 else f"the other ({calm[0]})"
    return [f"{head}{named}; {others}: no load effect{tail}"]


def _effect(verdict: Verdict) -> str:
    cause = f", {verdict.cause}" if verdict.cause else ""
    onset = f" from concurrency {verdict.onset_level}" if verdict.onset_level is not None else ""
    return f"{verdict.kind}{cause}{onset}"


def _median(values: Sequence[int]) -> int | None:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None


def sweep_command(group: Group, target: str, admin: str | None) -> str:
    """The controlled sweep that would settle what the live records suggest: through the proxy that
    recorded them, with the shape of the cut requests (model, dialect, prompt length, budget) at the
    levels they saw."""
    records = [s.record for s in group.samples]
    cut = [r for r in records if r.outcome in ("cut", "unknown")] or records
    budget = _median([r.requested_max_tokens for r in cut if r.requested_max_tokens]) or 256
    prompt = _median([r.prompt_tokens for r in cut if r.prompt_tokens])
    dialects = Counter(sweep_dialect_of(r.dialect) for r in cut)
    dialect = dialects.most_common(1)[0][0] if dialects else "openai"
    levels = ",".join(str(s.level) for s in group.summaries)
    parts = ["llm-diag-proxy sweep", f"--target {shlex.quote(target)}",
             *([f"--admin {shlex.quote(admin)}"] if admin else []), f"--model {shlex.quote(group.model)}",
             f"--dialect {dialect}", *([f"--prompt-tokens {prompt}"] if prompt else []), f"--max-tokens {budget}",
             f"--levels {levels}", "--repeats 5"]
    return " ".join(parts)


def level_note(group: Group) -> str | None:
    """Which levels the verdict leaves out, and why: too few records to compare."""
    if not group.thin_levels:
        return None
    left = ", ".join(f"c={level} ({n} record{'s' if n != 1 else ''})" for level, n in group.thin_levels)
    return f"left out for too few records: {left}"


def explain(group: Group, target: str, admin: str | None) -> list[str]:
    """What the verdict of live traffic can and cannot say."""
    lines = [f"  ({OBSERVATIONAL})"]
    note = level_note(group)
    if note is not None:
        lines.append(f"  ({note})")
    if group.verdict.kind in ("no_load_effect", "insufficient_data"):
        return lines
    lines.append("  To be sure it is the load, run the controlled sweep (the same request at each level):")
    lines.append(f"    {sweep_command(group, target, admin)}")
    return lines


ACTION_FIRST = {"serving_defect": 0, "policy": 1, "hidden_cap": 2, "baseline_truncation": 3, "length_shift": 4,
                "batch_nondeterminism": 5, "no_load_effect": 6, "insufficient_data": 7}


def needs_action_first(groups: Sequence[Group]) -> list[Group]:
    """The groups whose verdict asks for action first (a serving defect before a calm model), the
    largest first within each kind."""
    return sorted(groups, key=lambda g: (ACTION_FIRST.get(g.verdict.kind, 5), -len(g.samples)))


def verdict_json(groups: Sequence[Group], *, since: float, records: int, source: str, min_per_level: int,
                 target: str, admin: str | None) -> dict[str, Any]:
    """The verdict of live traffic as `/api/diagnose` answers it, the verdicts that need action first."""
    return {
        "since": since, "records": records, "source": source, "observational": OBSERVATIONAL,
        "note": ("no model and budget band has records at two concurrency levels with "
                 f"{min_per_level} or more each yet"),
        "groups": [{"name": g.name(), "model": g.model, "band": g.band, "n": len(g.samples),
                    **({g.scope[0]: g.scope[1]} if g.scope is not None else {}),
                    "levels": [{"level": s.level, "n": s.n, "completion_rate": s.completion_rate,
                                "output_tokens_median": s.output_tokens_median, "stop_counts": s.stop_counts}
                               for s in g.summaries],
                    "levels_left_out": [{"level": level, "n": n} for level, n in g.thin_levels],
                    "verdict": g.verdict.to_dict(),
                    "sweep": (None if g.verdict.kind in NO_EFFECT else sweep_command(g, target, admin))}
                   for g in needs_action_first(groups)]}


def count_lines(records: Sequence[ResponseRecord]) -> list[str]:
    """Servers whose own counts cannot be trusted: per upstream, the answers whose usage cannot all be
    true (`usage_mismatch`), with one of them said."""
    mismatched: dict[str, list[ResponseRecord]] = {}
    answered: Counter[str] = Counter()
    for record in records:
        if record.outcome == "not_inference":
            continue
        answered[record.upstream or "?"] += 1
        if record.usage_mismatch:
            mismatched.setdefault(record.upstream or "?", []).append(record)
    untrusted = [f"{upstream}: {len(bad)} of {answered[upstream]} answers carry counts that cannot all be true "
                 f"({bad[-1].usage_mismatch}): its usage is not to be trusted for them"
                 for upstream, bad in sorted(mismatched.items(), key=lambda item: -len(item[1]))]
    return untrusted + exact_truth_lines(records) + gate_lines(records)


def gate_lines(records: Sequence[ResponseRecord]) -> list[str]:
    """What the proxy's admission gate did: the answers since it first held one, how many complete, and
    the wait at the proxy (p95), beside the same share before it."""
    gated = [r for r in records if r.queue_time_source == "proxy" and r.queue_time_s is not None]
    if not gated:
        return []
    since = min(r.started_at for r in gated)
    answers = [r for r in records if r.outcome != "not_inference"]
    after = [r for r in answers if r.started_at >= since]
    before = [r for r in answers if r.started_at < since]
    waits = sorted(r.queue_time_s or 0.0 for r in gated)
    p95 = waits[min(len(waits) - 1, int(0.95 * len(waits)))]
    complete = sum(1 for r in after if r.outcome in ("complete", "budget"))
    line = (f"the proxy's admission gate: since it first held an answer, {complete} of {len(after)} answers "
            f"complete ({complete / len(after):.0%})")
    if before:
        earlier = sum(1 for r in before if r.outcome in ("complete", "budget"))
        line += f", against {earlier / len(before):.0%} before"
    return [f"{line}; p95 wait at the gate {p95:.2f} s over {len(gated)} answers"]


# How a length stop was settled without the server's own count of its output.
_INFERRED = frozenset({"server_tokenizer", "counted", "none", "request_unread"})


def exact_truth_lines(records: Sequence[ResponseRecord]) -> list[str]:
    """Servers whose length stops were settled by inference (the server's tokenizer and its budget rule)
    or stayed unknown, with the server's own switches that would give its exact count."""
    inferred: Counter[str] = Counter()
    unknown: Counter[str] = Counter()
    stops: Counter[str] = Counter()
    for record in records:
        if record.stop_reason != "length":
            continue
        upstream = record.upstream or "?"
        stops[upstream] += 1
        if record.length_cause in (None, "unknown"):
            unknown[upstream] += 1
        elif record.length_cause_source in _INFERRED:
            inferred[upstream] += 1
    lines = []
    for upstream in sorted(stops, key=lambda u: -(inferred[u] + unknown[u])):
        if not inferred[upstream] and not unknown[upstream]:
            continue
        said = " and ".join(part for part in (
            f"{inferred[upstream]} settled by inference (the server's tokenizer)" if inferred[upstream] else "",
            f"{unknown[upstream]} left unknown" if unknown[upstream] else "") if part)
        lines.append(f"{upstream}: of {stops[upstream]} length stops, {said}: for the server's own count, "
                     "run the proxy with --server-traces on and start vLLM with --otlp-traces-endpoint "
                     "http://ADMIN/v1/traces (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf), or with "
                     "--enable-force-include-usage so that every stream carries its usage; SGLang: "
                     "--enable-trace --otlp-traces-endpoint, and stream_options.include_usage")
    return lines
