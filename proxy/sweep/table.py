"""The per-level table the sweep prints: plain text, one row per concurrency level."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.sweep.stats import LevelSummary

COLUMNS = ("conc", "n", "out tok med [IQR]", "reasoning", "complete", "tok/s", "req/s", "TTFT p50/p95",
           "ITL p50/p95", "latency p50/p95/p99", "deadline", "disconn", "preempt", "VRAM free min", "KV max",
           "stop reasons")

# What each column means, for the report's legend and the README; one entry per column.
COLUMN_HELP: dict[str, str] = {
    "conc": "concurrency: requests kept in flight at once (closed loop)",
    "n": "responses measured at this level",
    "out tok med [IQR]": "output tokens per response: median [first-third quartile]; ~ marks counted chunks, "
                         "an estimate",
    "reasoning": "median share of the budget spent on reasoning, where the server reports it",
    "complete": "share of answers that ended on their own (EOS, a stop sequence, a tool call), with its 95% "
                "interval (Wilson) in brackets",
    "tok/s": "output tokens of all responses over the level's wall time (first sent to last ended)",
    "req/s": "responses over the level's wall time",
    "TTFT p50/p95": "time to first token, median/95th percentile",
    "ITL p50/p95": "mean inter-token latency per response, median/95th percentile",
    "latency p50/p95/p99": "end-to-end latency as the client saw it (send to last byte), percentiles",
    "deadline": "responses ended by a wall-clock or idle deadline",
    "disconn": "responses the client gave up on (the sweep's --timeout)",
    "preempt": "responses preempted at least once / responses whose record carried the server's "
               "preemption counter (server-wide: an estimate when requests overlap)",
    "VRAM free min": "least free GPU memory seen during the level's responses",
    "KV max": "highest KV-cache use the server reported during the level's responses",
    "stop reasons": "how the responses ended, most frequent first; length:server_limit is a cut below the "
                    "requested budget, length:requested_budget the client's own limit",
}


def seconds(value: float | None) -> str:
    """A duration for people: `850ms`, `2.41s`, `-` when unknown."""
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.2f}s"


def completion(summary: LevelSummary) -> str:
    """`25% [9-53]`: the completion rate with its 95% interval, in percent."""
    if summary.completion_low is None or summary.completion_high is None:
        return f"{summary.completion_rate:.0%}"
    return (f"{summary.completion_rate:.0%} [{summary.completion_low * 100:.0f}-"
            f"{summary.completion_high * 100:.0f}]")


def rate(value: float | None) -> str:
    """A per-second rate: `1234`, `12.5`, `0.42`; `-` when unknown."""
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f} GiB"


def stop_mix(counts: dict[str, int]) -> str:
    """`eos 12, length:server_limit 4`, most frequent first."""
    return ", ".join(f"{label} {count}" for label, count in sorted(counts.items(), key=lambda kv: -kv[1]))


def row(summary: LevelSummary) -> tuple[str, ...]:
    """The cells of one level's row, in COLUMNS order."""
    s = summary
    preempt = "-" if s.preempted_responses is None else f"{s.preempted_responses}/{s.preemptions_known}"
    return (
        str(s.level),
        str(s.n),
        f"{'~' if s.tokens_counted else ''}{s.output_tokens_median:g} [{s.output_tokens_q1:g}-{s.output_tokens_q3:g}]",
        "-" if s.reasoning_share_median is None else f"{s.reasoning_share_median:.0%}",
        completion(s),
        rate(s.output_tokens_per_s),
        rate(s.requests_per_s),
        f"{seconds(s.ttft_p50_s)}/{seconds(s.ttft_p95_s)}",
        f"{seconds(s.itl_p50_s)}/{seconds(s.itl_p95_s)}",
        f"{seconds(s.latency_p50_s)}/{seconds(s.latency_p95_s)}/{seconds(s.latency_p99_s)}",
        str(s.deadline_hits),
        str(s.client_disconnects),
        preempt,
        gib(s.vram_free_min_bytes),
        "-" if s.kv_cache_usage_max is None else f"{s.kv_cache_usage_max:.0%}",
        stop_mix(s.stop_counts),
    )


ESTIMATE_NOTE = "~ output tokens counted from content chunks (the server sent no usage): an estimate"


def render(summaries: Sequence[LevelSummary]) -> str:
    """The whole table with a header, columns padded to their widest cell; a note when tokens are estimates."""
    rows = [COLUMNS, *(row(s) for s in summaries)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.rjust(w) if i < len(COLUMNS) - 1 else cell
                       for i, (cell, w) in enumerate(zip(r, widths, strict=True))).rstrip() for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    if any(s.tokens_counted for s in summaries):
        lines.append(ESTIMATE_NOTE)
    return "\n".join(lines)
