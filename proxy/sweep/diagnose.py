"""`llm-diag-proxy diagnose`: the sweep's verdict applied to the proxy's own records of live traffic.

The records come from the history database (`--history PATH`) or from a running proxy
(`--admin URL`, paging through `/api/requests`). Only comparable requests are compared: they are
grouped by model and by requested-budget band (powers of two), and within a group by the
concurrency each one saw (the bucket of its `concurrency_peak`), which plays the part of the
sweep's levels. Each group then goes through the sweep's own code: the per-level summaries, the
table, the verdict, `sweep.json`/`sweep.csv` and the HTML report.

This is observational, and it says so: live requests differ in prompt and in what they ask, and
the busy hours may differ from the quiet ones in more than concurrency, so a difference between
levels can have another cause. When a group shows an effect, the output prints the controlled
sweep that would settle it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from proxy.cli import CliError, flag_type
from proxy.concurrency import concurrency_bucket
from proxy.config import parse_duration, parse_positive_int, parse_upstream_url
from proxy.record import ResponseRecord, record_from_dict
from proxy.sweep import export, table
from proxy.sweep.cli import exit_code, parse_verdicts
from proxy.sweep.sample import ClientMeasure, Sample
from proxy.sweep.stats import LevelSummary, by_level, summarize
from proxy.sweep.verdict import Verdict, decide

MAX_RECORDS = 200_000
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


# --- where the records come from -------------------------------------------------------------
def from_history(path: str, since: float, until: float | None) -> list[ResponseRecord]:
    from proxy.history import History

    if not Path(path).exists():
        raise CliError(f"no history database at {path} (the proxy's --history)")
    history = History(path, max_age_s=0, max_bytes=0)
    try:
        return history.between(since, until, MAX_RECORDS)
    except Exception as exc:  # sqlite3.Error and friends: one line, not a traceback
        raise CliError(f"cannot read the history at {path}: {exc}") from None


async def from_admin(admin: str, token: str | None, since: float, until: float | None) -> list[ResponseRecord]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    found: list[ResponseRecord] = []
    cursor: Any = None
    params = {"since": f"{since:.3f}", "limit": "1000", **({"until": f"{until:.3f}"} if until else {})}
    timeout = aiohttp.ClientTimeout(total=60)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while len(found) < MAX_RECORDS:
                query = {**params, **({"cursor": str(cursor)} if cursor is not None else {})}
                async with session.get(f"{admin}/api/requests", params=query, headers=headers) as response:
                    if response.status != 200:
                        raise CliError(f"the admin API at {admin} answered HTTP {response.status}"
                                       + (" (is --admin-token right?)" if response.status == 401 else ""))
                    page = orjson.loads(await response.read())
                found += [record_from_dict(r) for r in page["records"]]
                cursor = page.get("next_cursor")
                if cursor is None:
                    break
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise CliError(f"cannot reach the proxy's admin API at {admin}: {type(exc).__name__}: {exc}"[:300]) from None
    return found


# --- the command -----------------------------------------------------------------------------
def register(subparsers: Any) -> None:
    from proxy.sweep.cli import VERDICT_KINDS

    parser = subparsers.add_parser(
        "diagnose", help="the sweep's verdict on the proxy's records of live traffic (observational)",
        description="Groups the proxy's records of live traffic by model, budget band and the concurrency "
                    "each saw, and applies the sweep's rules: completion and output length by level, the "
                    "dominant cause and where it starts. Observational: it says when a controlled sweep is "
                    "needed to be sure.")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--history", default=None, metavar="PATH",
                        help="the proxy's history database (default: the proxy's default location)")
    source.add_argument("--admin", type=flag_type(parse_upstream_url), default=None, metavar="URL",
                        help="a running proxy's admin URL (reads /api/requests)")
    parser.add_argument("--admin-token", default=os.environ.get("LLM_DIAG_ADMIN_TOKEN") or None,
                        help="bearer token of the admin API (env LLM_DIAG_ADMIN_TOKEN)")
    parser.add_argument("--since", type=flag_type(parse_duration), default=3600.0, metavar="AGE",
                        help="records of the last AGE: 30m, 1h, 1d (default 1h)")
    parser.add_argument("--model", default=None, help="only this model")
    parser.add_argument("--min-per-level", type=flag_type(parse_positive_int), default=MIN_PER_LEVEL, metavar="N",
                        help="a concurrency level needs this many records to count (default %(default)s)")
    parser.add_argument("--target", default="http://127.0.0.1:8080", metavar="URL",
                        help="the proxy's URL, for the sweep command it suggests (default %(default)s)")
    parser.add_argument("--out-dir", default=None, metavar="DIR",
                        help="write diagnose.json and diagnose.csv per group here (default: not written)")
    parser.add_argument("--report", default=None, metavar="FILE.html",
                        help="the HTML report of the largest group, as the sweep's")
    parser.add_argument("--fail-on", type=flag_type(parse_verdicts), default=None, metavar="VERDICTS",
                        help=f"exit 1 when a group's verdict is one of: {', '.join(VERDICT_KINDS)}")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    since = time.time() - args.since
    if args.admin is not None:
        records = asyncio.run(from_admin(args.admin, args.admin_token, since, None))
        where = args.admin
    else:
        from proxy.history import default_path

        path = args.history or os.environ.get("LLM_DIAG_HISTORY") or default_path()
        records = from_history(path, since, None)
        where = path
    groups = groups_of(records, model=args.model, min_per_level=args.min_per_level)
    admin = args.admin or "http://127.0.0.1:9464"
    out = sys.stdout
    out.write(f"llm-diag-proxy diagnose: {len(records)} records since "
              f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))} from {where}\n")
    if not groups:
        out.write(f"VERDICT (insufficient_data): no model and budget band has records at two concurrency levels "
                  f"with {args.min_per_level} or more each; widen --since, lower --min-per-level, or run the "
                  f"controlled sweep\n")
        return exit_code(Verdict("insufficient_data", "", None, None, False, (), ""), args.fail_on)
    code = 0
    for number, group in enumerate(groups):
        out.write(f"\n== {group.name()}: {len(group.samples)} answers\n{table.render(group.summaries)}\n\n"
                  f"{group.verdict.text()}\n" + "\n".join(explain(group, args.target, admin)) + "\n")
        try:
            write_files(group, number, args, where, since)
        except OSError as exc:
            raise CliError(f"cannot write the diagnose files: {exc}") from None
        code = max(code, exit_code(group.verdict, args.fail_on, sys.stderr))
    out.flush()
    return code


def write_files(group: Group, number: int, args: argparse.Namespace, where: str, since: float) -> None:
    plan = {"kind": "diagnose (observational)", "model": group.model, "budget_band": group.band,
            "since": since, "source": where, "note": OBSERVATIONAL,
            "levels": ",".join(str(s.level) for s in group.summaries),
            "run": {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "tool": "llm-diag-proxy diagnose",
                    "target": where, "model": group.model, "server_type": "live traffic"}}
    if args.out_dir is not None:
        directory = Path(args.out_dir)
        directory.mkdir(parents=True, exist_ok=True)
        suffix = "" if number == 0 else f"-{number}"
        (directory / f"diagnose{suffix}.json").write_bytes(
            export.sweep_json(plan, group.summaries, group.verdict, group.samples))
        (directory / f"diagnose{suffix}.csv").write_text(export.sweep_csv(group.samples, group.summaries),
                                                         encoding="utf-8")
    if args.report is not None and number == 0:
        from proxy.sweep import report

        Path(args.report).write_text(report.render(group.summaries, by_level(group.samples), group.verdict, plan),
                                     encoding="utf-8")

