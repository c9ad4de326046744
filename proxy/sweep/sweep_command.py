"""`llm-diag-proxy sweep`: run the concurrency sweep, print the table and the verdict, write the files."""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any, cast, get_args

from proxy.config import (
    CliError,
    ConfigError,
    flag_type,
    parse_positive_int,
    parse_positive_seconds,
    parse_seconds,
    parse_upstream_url,
)
from proxy.sweep.open_loop import Slo, parse_rates, parse_slo
from proxy.sweep.runner import SWEEP_DIALECTS, SweepDialect, SweepPlan
from proxy.sweep.session import compare_files, execute, exit_code
from proxy.sweep.verdict import VerdictKind

DEFAULT_PROMPT = ("Explain in five short paragraphs how a bicycle's gears work, "
                  "then give three tips for shifting smoothly.")
DEFAULT_LEVELS = "1,2,4,8"
DEFAULT_TIMEOUT_S = 120.0
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


MAX_PROMPT_TOKENS = 1_000_000


def parse_prompt_tokens(value: str) -> int:
    number = parse_integer(value)
    if not 1 <= number <= MAX_PROMPT_TOKENS:
        raise ConfigError(f"invalid prompt length {value!r}: expected 1 to {MAX_PROMPT_TOKENS:,} tokens")
    return number


def parse_temperature(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"invalid temperature {value!r}") from None
    if not 0 <= number <= 10:
        raise ConfigError(f"invalid temperature {value!r}: expected 0 to 10")
    return number


VERDICT_KINDS: tuple[str, ...] = get_args(VerdictKind)


def parse_verdicts(value: str) -> frozenset[str]:
    """`serving_defect,policy` -> the verdict kinds that fail the run (exit 1)."""
    kinds = {p.strip() for p in value.split(",") if p.strip()}
    unknown = sorted(kinds - set(VERDICT_KINDS))
    if not kinds or unknown:
        raise ConfigError(f"invalid verdict {', '.join(map(repr, unknown)) or repr(value)}: expected a "
                          f"comma-separated list of {', '.join(VERDICT_KINDS)}")
    return frozenset(kinds)


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """The request and level flags; `demo` reuses them with its own short defaults (set_defaults)."""
    parser.add_argument("--levels", type=flag_type(parse_levels), default=parse_levels(DEFAULT_LEVELS),
                        help="concurrency levels, comma-separated (default 1,2,4,8)")
    parser.add_argument("--repeats", type=flag_type(parse_positive_int), default=5,
                        help="requests per in-flight slot: level L sends L x repeats requests "
                             "(default %(default)s)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the one prompt every request sends")
    parser.add_argument("--prompt-tokens", type=flag_type(parse_prompt_tokens), default=None, metavar="N",
                        help="instead of --prompt: a synthetic prompt of about N tokens (words that are one token "
                             "each), to repeat the length of recorded prompts, which the proxy never keeps")
    parser.add_argument("--max-tokens", type=flag_type(parse_positive_int), default=256,
                        help="requested output budget per request (default %(default)s)")
    parser.add_argument("--seed", type=flag_type(parse_integer), default=42,
                        help="sampling seed, the same for every request (default %(default)s)")
    parser.add_argument("--temperature", type=flag_type(parse_temperature), default=0.0,
                        help="sampling temperature (default %(default)s)")
    parser.add_argument("--timeout", type=flag_type(parse_seconds), default=None, metavar="SECONDS",
                        help="the client gives up on a response after this long, 0 = never (default 120; the "
                             "arms of --admission: never, unless given)")
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
                    "one identical (prompt, budget, seed); prints a table per level and a verdict. With --rates, "
                    "open loop: requests arrive at each rate whatever is in flight, scored by goodput.")
    parser.add_argument("--admission", type=flag_type(parse_levels), default=(), metavar="N[,M...]",
                        help="the experiment's second arm: the same levels again with the proxy's admission gate "
                             "at each N (through --admin, put back afterwards), side by side with the first, and "
                             "whether the cap removes the cut")
    parser.add_argument("--compare", nargs=2, default=None, metavar=("A/sweep.json", "B/sweep.json"),
                        help="compare two saved sweeps (before and after a server change) level by level, and "
                             "say whether the change removed the cut; runs nothing")
    parser.add_argument("--target", type=flag_type(parse_upstream_url), metavar="URL",
                        help="base URL to send requests to: the proxy (or the server itself)")
    parser.add_argument("--admin", type=flag_type(parse_upstream_url), default=None, metavar="URL",
                        help="the proxy's admin URL: join each response with the proxy's record "
                             "(without it, stop reasons come from the sweep's own parse)")
    parser.add_argument("--admin-token", default=os.environ.get("LLM_DIAG_ADMIN_TOKEN") or None,
                        help="bearer token of the admin API (env LLM_DIAG_ADMIN_TOKEN)")
    parser.add_argument("--model", help="the model name sent in every request")
    parser.add_argument("--dialect", choices=SWEEP_DIALECTS, default="openai",
                        help="openai: /v1/chat/completions (SSE); ollama: /api/chat (NDJSON); "
                             "anthropic: /v1/messages; responses: /v1/responses (default openai)")
    parser.add_argument("--rates", type=flag_type(parse_rates), default=None, metavar="R1,R2,...",
                        help="open loop instead of --levels: requests per second, sent on time whatever is in "
                             "flight (e.g. 1,2,4,8); the verdict's levels are the concurrency each request met")
    parser.add_argument("--arrivals", choices=("constant", "poisson"), default="constant",
                        help="open loop: evenly spaced, or Poisson arrivals from --seed (default constant)")
    parser.add_argument("--rate-seconds", type=flag_type(parse_positive_seconds), default=30.0, metavar="SECONDS",
                        help="open loop: how long each rate sends (default %(default)s)")
    parser.add_argument("--slo", type=flag_type(parse_slo), default=None, metavar="TARGETS",
                        help="goodput's targets, e.g. ttft=500ms,itl=50ms,e2e=30s: an answer counts when it "
                             "ended on its own within all of them (default: ended on its own)")
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
                     timeout_s=DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout,
                     warmup=getattr(args, "warmup", 1),
                     rates=getattr(args, "rates", None) or (), arrivals=getattr(args, "arrivals", "constant"),
                     rate_seconds=getattr(args, "rate_seconds", 30.0), slo=_slo_text(getattr(args, "slo", None)),
                     prompt_tokens=getattr(args, "prompt_tokens", None))


def _slo_text(slo: Slo | None) -> str | None:
    if slo is None:
        return None
    parts = [f"{name}={value}s" for name, value in (("ttft", slo.ttft_s), ("itl", slo.itl_s), ("e2e", slo.e2e_s))
             if value is not None]
    return ",".join(parts)


def run(args: argparse.Namespace) -> int:
    if args.compare is not None:
        print(compare_files(*args.compare))
        return 0
    if args.target is None or args.model is None:
        raise CliError("sweep needs --target and --model (or --compare A/sweep.json B/sweep.json)")
    if args.admission and args.admin is None:
        raise CliError("--admission sets the proxy's admission gate: give the proxy's --admin URL (and "
                       "--target the proxy)")
    plan = plan_from_args(args, args.target, args.admin, args.model, args.dialect)
    outcome = asyncio.run(execute(plan, out_dir=args.out_dir, report_path=args.report,
                                  progress=not args.no_progress, admission=args.admission,
                                  gated_timeout_s=args.timeout or 0.0))
    return exit_code(outcome.verdict, args.fail_on)
