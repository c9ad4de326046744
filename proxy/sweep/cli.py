"""`llm-diag-proxy sweep`: run the concurrency sweep, print the table and the verdict, write the files."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO, cast, get_args

from proxy import __version__
from proxy.cli import CliError, flag_type
from proxy.config import ConfigError, parse_positive_int, parse_seconds, parse_upstream_url
from proxy.server_info import ServerInfo
from proxy.sweep import export, table
from proxy.sweep.progress import ProgressBar
from proxy.sweep.runner import SWEEP_DIALECTS, SweepDialect, SweepError, SweepPlan, run_sweep
from proxy.sweep.sample import Sample
from proxy.sweep.stats import LevelSummary, by_level, summarize
from proxy.sweep.verdict import Verdict, VerdictKind, decide

DEFAULT_PROMPT = ("Explain in five short paragraphs how a bicycle's gears work, "
                  "then give three tips for shifting smoothly.")
DEFAULT_LEVELS = "1,2,4,8"
MAX_LEVEL = 4096


def parse_levels(value: str) -> tuple[int, ...]:
    """`1,2,4,8` -> (1, 2, 4, 8): positive, distinct, sorted ascending."""
    parts = [p.strip() for p in value.split(",") if p.strip()]
    if not parts:
        raise ConfigError(f"invalid levels {value!r}: expected a list like 1,2,4,8")
    levels: set[int] = set()
    for part in parts:
        if not part.isdigit() or not 1 <= int(part) <= MAX_LEVEL:
            raise ConfigError(f"invalid level {part!r} in {value!r}: each must be 1 to {MAX_LEVEL}")
        levels.add(int(part))
    return tuple(sorted(levels))


def parse_integer(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"invalid integer {value!r}") from None


def parse_temperature(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"invalid temperature {value!r}") from None
    if not 0 <= number <= 10:
        raise ConfigError(f"invalid temperature {value!r}: expected 0 to 10")
    return number


VERDICT_KINDS: tuple[str, ...] = get_args(VerdictKind)
FAIL_EXIT = 1  # a verdict named in --fail-on; 2 stays a usage or connection error


def parse_verdicts(value: str) -> frozenset[str]:
    """`serving_defect,policy` -> the verdict kinds that fail the run (exit 1)."""
    kinds = {p.strip() for p in value.split(",") if p.strip()}
    unknown = sorted(kinds - set(VERDICT_KINDS))
    if not kinds or unknown:
        raise ConfigError(f"invalid verdict {', '.join(map(repr, unknown)) or repr(value)}: expected a "
                          f"comma-separated list of {', '.join(VERDICT_KINDS)}")
    return frozenset(kinds)


def exit_code(verdict: Verdict, fail_on: frozenset[str] | None, stderr: TextIO | None = None) -> int:
    """FAIL_EXIT, with one line on stderr, when the verdict is one the user asked to fail on; else 0."""
    if not fail_on or verdict.kind not in fail_on:
        return 0
    print(f"llm-diag-proxy: verdict {verdict.kind} is in --fail-on: exit {FAIL_EXIT}",
          file=stderr or sys.stderr, flush=True)
    return FAIL_EXIT


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """The request and level flags; `demo` reuses them with its own short defaults (set_defaults)."""
    parser.add_argument("--levels", type=flag_type(parse_levels), default=parse_levels(DEFAULT_LEVELS),
                        help="concurrency levels, comma-separated (default 1,2,4,8)")
    parser.add_argument("--repeats", type=flag_type(parse_positive_int), default=5,
                        help="requests per in-flight slot: level L sends L x repeats requests "
                             "(default %(default)s)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the one prompt every request sends")
    parser.add_argument("--max-tokens", type=flag_type(parse_positive_int), default=256,
                        help="requested output budget per request (default %(default)s)")
    parser.add_argument("--seed", type=flag_type(parse_integer), default=42,
                        help="sampling seed, the same for every request (default %(default)s)")
    parser.add_argument("--temperature", type=flag_type(parse_temperature), default=0.0,
                        help="sampling temperature (default %(default)s)")
    parser.add_argument("--timeout", type=flag_type(parse_seconds), default=120.0, metavar="SECONDS",
                        help="the client gives up on a response after this long, 0 = never "
                             "(default %(default)s)")
    parser.add_argument("--out-dir", default=".", metavar="DIR",
                        help="where sweep.json and sweep.csv go (default: %(default)s; "
                             "for demo: not written unless given)")
    parser.add_argument("--report", default=None, metavar="FILE.html",
                        help="also write a self-contained HTML report with charts")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--fail-on", type=flag_type(parse_verdicts), default=None, metavar="VERDICTS",
                        help="exit 1 when the verdict is one of these, for a CI gate: comma-separated, of "
                             f"{', '.join(VERDICT_KINDS)} (default: always exit 0 once the sweep ran)")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "sweep", help="the same request at rising concurrency, with a verdict on what changed",
        description="Closed-loop sweep: at each level exactly L streaming requests are in flight, every "
                    "one identical (prompt, budget, seed); prints a table per level and a verdict.")
    parser.add_argument("--target", required=True, type=flag_type(parse_upstream_url), metavar="URL",
                        help="base URL to send requests to: the proxy (or the server itself)")
    parser.add_argument("--admin", type=flag_type(parse_upstream_url), default=None, metavar="URL",
                        help="the proxy's admin URL: join each response with the proxy's record "
                             "(without it, stop reasons come from the sweep's own parse)")
    parser.add_argument("--admin-token", default=os.environ.get("LLM_DIAG_ADMIN_TOKEN") or None,
                        help="bearer token of the admin API (env LLM_DIAG_ADMIN_TOKEN)")
    parser.add_argument("--model", required=True, help="the model name sent in every request")
    parser.add_argument("--dialect", choices=SWEEP_DIALECTS, default="openai",
                        help="openai: /v1/chat/completions (SSE); ollama: /api/chat (NDJSON); "
                             "anthropic: /v1/messages; responses: /v1/responses (default openai)")
    parser.add_argument("--warmup", type=flag_type(parse_non_negative_int), default=1,
                        help="unrecorded requests sent first, so a model load is not measured (default 1)")
    add_sweep_arguments(parser)
    parser.set_defaults(func=run)


def parse_non_negative_int(value: str) -> int:
    number = parse_integer(value)
    if number < 0:
        raise ConfigError(f"invalid value {value!r}: must be 0 or more")
    return number


def plan_from_args(args: argparse.Namespace, target: str, admin: str | None, model: str,
                   dialect: str = "openai") -> SweepPlan:
    return SweepPlan(target=target, admin=admin, admin_token=getattr(args, "admin_token", None),
                     levels=args.levels, repeats=args.repeats, prompt=args.prompt, max_tokens=args.max_tokens,
                     seed=args.seed, temperature=args.temperature, model=model,
                     dialect=cast(SweepDialect, dialect if dialect in SWEEP_DIALECTS else "openai"),
                     timeout_s=args.timeout or 0.0, warmup=getattr(args, "warmup", 1))


@dataclass(frozen=True, slots=True)
class SweepOutcome:
    samples: list[Sample]
    summaries: list[LevelSummary]
    verdict: Verdict
    written: list[Path]
    server: ServerInfo | None = None


def analyse(samples: Sequence[Sample], plan: SweepPlan,
            server: ServerInfo | None = None) -> tuple[list[LevelSummary], Verdict]:
    """Per-level summaries and the verdict of a finished sweep (pure)."""
    summaries = summarize(samples)
    verdict = decide(summaries, by_level(samples), client_timeout_s=plan.timeout_s or None, server=server)
    return summaries, verdict


async def execute(plan: SweepPlan, *, out_dir: str | None, report_path: str | None, progress: bool,
                  stdout: TextIO | None = None) -> SweepOutcome:
    """Run the sweep, print the table and the verdict, write the requested files."""
    out = stdout if stdout is not None else sys.stdout
    bar = ProgressBar(plan.total, enabled=progress)
    try:
        run = await run_sweep(plan, on_level_start=bar.start_level, on_done=bar.advance,
                              on_level_done=bar.level_done)
    except SweepError as exc:
        raise CliError(str(exc)) from None
    finally:
        bar.close()
    samples = run.samples
    summaries, verdict = analyse(samples, plan, run.server)
    described = {**plan.to_dict(), "server": run.server.to_dict() if run.server is not None else None,
                 "run": run_metadata(plan, run.server)}
    written: list[Path] = []
    try:
        if out_dir is not None:
            directory = Path(out_dir)
            directory.mkdir(parents=True, exist_ok=True)
            json_path, csv_path = directory / "sweep.json", directory / "sweep.csv"
            json_path.write_bytes(export.sweep_json(described, summaries, verdict, samples))
            csv_path.write_text(export.sweep_csv(samples, summaries), encoding="utf-8")
            written += [json_path, csv_path]
        if report_path is not None:
            from proxy.sweep import report  # imported late: plotly is only needed here

            page = report.render(summaries, by_level(samples), verdict, described)
            path = Path(report_path)
            path.write_text(page, encoding="utf-8")
            written.append(path)
    except OSError as exc:
        raise CliError(f"cannot write the sweep's files: {exc}") from None
    joined = sum(s.joined for s in summaries)
    source = (f"records joined from the proxy: {joined} of {len(samples)}" if plan.admin
              else "no --admin: stop reasons come from the sweep's own parse of each stream")
    source = "; ".join([source, *run.notes])
    notes = [s.join_note for s in samples if s.join_note]
    if notes:
        source += (f"; {len(notes)} used the sweep's own record instead ({notes[0]}); is --target the proxy "
                   "that --admin belongs to?")
    out.write(f"{table.render(summaries)}\n({source})\n\n{verdict.text()}\n")
    if written:
        out.write("wrote " + ", ".join(str(p) for p in written) + "\n")
    out.flush()
    return SweepOutcome(list(samples), summaries, verdict, written, run.server)


def server_type(server: ServerInfo | None) -> str:
    """`llama.cpp`, `vLLM`, `Ollama`: named by the endpoint that described the server's context."""
    if server is None:
        return "not identified (no llama.cpp /props, vLLM max_model_len or Ollama /api/ps answer)"
    return server.source.split(" GET ")[0]


def run_metadata(plan: SweepPlan, server: ServerInfo | None) -> dict[str, Any]:
    """What a reader of a saved report needs to know which run it is."""
    return {"date": datetime.now(UTC).isoformat(timespec="seconds"), "tool": "llm-diag-proxy",
            "version": __version__, "target": plan.target, "model": plan.model, "dialect": plan.dialect,
            "server_type": server_type(server), "joined_from_proxy": plan.admin is not None}


def run(args: argparse.Namespace) -> int:
    plan = plan_from_args(args, args.target, args.admin, args.model, args.dialect)
    outcome = asyncio.run(execute(plan, out_dir=args.out_dir, report_path=args.report,
                                  progress=not args.no_progress))
    return exit_code(outcome.verdict, args.fail_on)
