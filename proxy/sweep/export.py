"""The sweep's files: `sweep.json` (everything) and `sweep.csv` (one row per response)."""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from proxy.sweep.sample import Sample
from proxy.sweep.stats import LevelSummary, stop_label
from proxy.sweep.verdict import Verdict

CSV_RECORD_FIELDS = (
    "status", "stop_reason", "length_cause", "finish_reason_raw", "requested_max_tokens", "output_tokens",
    "tokens_source", "reasoning_tokens", "visible_tokens", "reasoning_share",
    "ttft_s", "itl_mean_s", "itl_p95_s", "itl_max_s", "duration_s", "queue_time_s",
    "deadline_hit", "client_disconnected", "upstream_error", "preemptions_during", "vram_free_min_bytes",
    "kv_cache_usage_max", "concurrency_at_start", "concurrency_mean", "concurrency_peak",
)
# The level's figures repeated on each of its rows, so one sheet answers both per-response and
# per-level questions.
CSV_LEVEL_FIELDS = ("output_tokens_per_s", "requests_per_s", "latency_p50_s", "latency_p95_s", "latency_p99_s")
CSV_COLUMNS = ("level", "index", "request_id", "record_source", "stop_label", *CSV_RECORD_FIELDS,
               "client_sent_s", "client_ttft_s", "client_duration_s", "client_error", "join_note",
               *(f"level_{name}" for name in CSV_LEVEL_FIELDS))


def sweep_json(plan: Mapping[str, Any], summaries: Sequence[LevelSummary], verdict: Verdict,
               samples: Sequence[Sample], arms: Sequence[Mapping[str, Any]] = ()) -> bytes:
    """Every record with the plan, the per-level summaries and the verdict (and the second arm's, by
    limit, where it ran)."""
    return orjson.dumps({
        "plan": dict(plan),
        "levels": [s.to_dict() for s in summaries],
        "verdict": verdict.to_dict(),
        "samples": [s.to_dict() for s in samples],
        **({"arms": list(arms)} if arms else {}),
    }, option=orjson.OPT_INDENT_2)


def sweep_csv(samples: Sequence[Sample], summaries: Sequence[LevelSummary]) -> str:
    """One row per response, the columns of CSV_COLUMNS; empty cells where a figure is unknown."""
    levels = {summary.level: summary for summary in summaries}
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for s in samples:
        record = s.record
        summary = levels.get(s.level)
        writer.writerow([
            s.level, s.index, s.request_id, s.record_source, stop_label(record),
            *(_cell(getattr(record, name)) for name in CSV_RECORD_FIELDS),
            _cell(s.client.sent_s), _cell(s.client.ttft_s), _cell(s.client.duration_s), _cell(s.client.error),
            _cell(s.join_note), *(_cell(getattr(summary, name, None)) for name in CSV_LEVEL_FIELDS),
        ])
    return out.getvalue()


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
