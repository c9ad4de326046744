"""The per-level table the sweep prints: plain text, one row per concurrency level."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.sweep.stats import LevelSummary

COLUMNS = ("conc", "n", "out tok med [IQR]", "reasoning", "complete", "TTFT p50/p95", "ITL p50/p95", "deadline",
           "disconn", "preempt", "VRAM free min", "KV max", "stop reasons")


def seconds(value: float | None) -> str:
    """A duration for people: `850ms`, `2.41s`, `-` when unknown."""
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.2f}s"


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
        f"{s.completion_rate:.0%}",
        f"{seconds(s.ttft_p50_s)}/{seconds(s.ttft_p95_s)}",
        f"{seconds(s.itl_p50_s)}/{seconds(s.itl_p95_s)}",
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
