"""One sweep run from a plan to its output: the run, the per-level table and the verdict printed,
sweep.json, sweep.csv and the HTML report written. What `sweep` runs, and `demo` through the proxy
it starts."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import orjson

from proxy import __version__
from proxy.config import CliError
from proxy.servers.base import ServerInfo
from proxy.sweep import export, open_loop, table
from proxy.sweep.arms import Arm, ArmError, Gate, compare_lines, side_by_side, verdict_lines
from proxy.sweep.live import exact_truth_lines
from proxy.sweep.open_loop import Slo, parse_slo
from proxy.sweep.progress import ProgressBar
from proxy.sweep.runner import SweepError, SweepPlan, run_sweep
from proxy.sweep.sample import Sample
from proxy.sweep.stats import LevelSummary, by_level, summarize
from proxy.sweep.verdict import COMPLETION_DROP, MIN_CUT, Verdict, decide

OPEN_LOOP_MIN_PER_LEVEL = 3
FAIL_EXIT = 1  # a verdict named in --fail-on; 2 stays a usage or connection error


def exit_code(verdict: Verdict, fail_on: frozenset[str] | None, stderr: TextIO | None = None) -> int:
    """FAIL_EXIT, with one line on stderr, when the verdict is one the user asked to fail on; else 0."""
    if not fail_on or verdict.kind not in fail_on:
        return 0
    print(f"llm-diag-proxy: verdict {verdict.kind} is in --fail-on: exit {FAIL_EXIT}",
          file=stderr or sys.stderr, flush=True)
    return FAIL_EXIT


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
    judged = samples
    if plan.open_loop:  # a concurrency that only one or two requests happened to meet is no level to compare
        sizes = {s.level: s.n for s in summaries}
        judged = [s for s in samples if sizes[s.level] >= OPEN_LOOP_MIN_PER_LEVEL]
    verdict = decide(summarize(judged), by_level(judged), client_timeout_s=plan.timeout_s or None, server=server)
    return summaries, verdict


async def execute(plan: SweepPlan, *, out_dir: str | None, report_path: str | None, progress: bool,
                  stdout: TextIO | None = None, admission: Sequence[int] = (),
                  gated_timeout_s: float = 0.0) -> SweepOutcome:
    """Run the sweep, print the table and the verdict, write the requested files; with `admission`,
    the second arm at each limit (`proxy.sweep.arms`), side by side with the first."""
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
    plan = run.plan or plan
    summaries, verdict = analyse(samples, plan, run.server)
    described = {**plan.to_dict(), "server": run.server.to_dict() if run.server is not None else None,
                 "run": run_metadata(plan, run.server)}
    rates_text = ""
    if plan.open_loop:
        slo = parse_slo(plan.slo) if plan.slo else Slo()
        rates = open_loop.summarize_rates(samples, slo, plan.rate_seconds)
        verdict = open_loop_verdict(verdict, rates)
        described["rates_summary"] = [r.to_dict() for r in rates]
        described["slo"] = slo.describe()
        rates_text = open_loop.render(rates, slo) + "\n\nby the concurrency each request met:\n"
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
    out.write(f"{rates_text}{table.render(summaries)}\n({source})\n\n{verdict.text()}\n")
    for line in exact_truth_lines([s.record for s in samples]):  # how to have the server's own counts
        out.write(f"  note: {line}\n")
    if admission:
        arms = await second_arm(plan, Arm.of(None, summaries, verdict, samples), admission, gated_timeout_s,
                                progress)
        out.write(f"\nTHE SECOND ARM: the same levels under the proxy's admission gate\n{side_by_side(arms)}\n\n"
                  + "\n".join(verdict_lines(arms[0], arms[1:])) + "\n")
        if out_dir is not None:  # (again, with the arms: the first arm's files stand if the second is cut short)
            try:
                (Path(out_dir) / "sweep.json").write_bytes(export.sweep_json(
                    described, summaries, verdict, samples, [arm.to_dict() for arm in arms[1:]]))
            except OSError as exc:
                raise CliError(f"cannot write the sweep's files: {exc}") from None
    if written:
        out.write("wrote " + ", ".join(str(p) for p in written) + "\n")
    out.flush()
    return SweepOutcome(list(samples), summaries, verdict, written, run.server)


async def second_arm(plan: SweepPlan, first: Arm, limits: Sequence[int], timeout_s: float,
                     progress: bool) -> list[Arm]:
    """The same sweep under the proxy's gate at each limit, the gate put back as it was afterwards
    (interrupted too)."""
    assert plan.admin is not None
    arms = [first]
    async with aiohttp.ClientSession() as session:
        gate = Gate(session, plan.admin, plan.admin_token)
        try:
            for limit in limits:
                await gate.set(limit)
                arm_plan = replace(plan, timeout_s=timeout_s, warmup=0)
                bar = ProgressBar(arm_plan.total, enabled=progress)
                try:
                    run = await run_sweep(arm_plan, on_level_start=bar.start_level, on_done=bar.advance,
                                          on_level_done=bar.level_done)
                finally:
                    bar.close()
                summaries, verdict = analyse(run.samples, arm_plan, run.server)
                arms.append(Arm.of(limit, summaries, verdict, run.samples))
        except ArmError as exc:
            raise CliError(str(exc)) from None
        except SweepError as exc:
            raise CliError(str(exc)) from None
        finally:
            await gate.restore()
    return arms


def compare_files(before: str, after: str) -> str:
    """`sweep --compare A/sweep.json B/sweep.json`: the two runs side by side, and what changed."""
    arms = []
    for name, path in (("before", before), ("after", after)):
        try:
            data = orjson.loads(Path(path).read_bytes())
            arm = Arm.from_dict(data)
        except (OSError, orjson.JSONDecodeError, ValueError, AttributeError) as exc:
            raise CliError(f"--compare: cannot read {path} as a sweep.json: {exc}"[:300]) from None
        arms.append(replace(arm, limit=None, label=name))
    return f"{side_by_side(arms)}\n\n" + "\n".join(compare_lines(arms[0], arms[1]))


def open_loop_verdict(verdict: Verdict, rates: Sequence[open_loop.RateSummary]) -> Verdict:
    """The verdict by the concurrency met, with the arrival rate from which answers are cut."""
    onset = open_loop.rate_onset(rates, COMPLETION_DROP, MIN_CUT)
    line = "completion by arrival rate: " + ", ".join(
        f"{r.rate:g}/s: {r.completion_rate:.0%} ({r.complete}/{r.sent}), met concurrency up to {r.concurrency_max}"
        for r in rates)
    headline = verdict.headline
    if onset is not None:
        headline += f" (by arrival rate: from {onset.rate:g} requests/s)"
    return replace(verdict, headline=headline, evidence=(line, *verdict.evidence))


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
