"""`llm-diag-proxy diagnose`: the sweep's verdict applied to the proxy's own records of live traffic.

The records come from the history database (`--history PATH`) or from a running proxy
(`--admin URL`, paging through `/api/requests`). Only comparable requests are compared: they are
grouped by model and by requested-budget band (powers of two), and within a group by the
concurrency each one saw (the bucket of its `concurrency_peak`), which plays the part of the
sweep's levels (proxy.sweep.live). Each group then goes through the sweep's own code: the
per-level summaries, the table, the verdict, `sweep.json`/`sweep.csv` and the HTML report.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from proxy.config import CliError, ConfigError, flag_type, parse_duration, parse_positive_int, parse_upstream_url
from proxy.observers.record_store import RecordQuery
from proxy.record import ResponseRecord, record_from_dict
from proxy.sweep import export, live, table, timeouts, whose
from proxy.sweep.live import BY, MIN_PER_LEVEL, OBSERVATIONAL, Group, compare, explain, groups_of, needs_action_first
from proxy.sweep.session import exit_code
from proxy.sweep.stats import by_level
from proxy.sweep.sweep_command import parse_verdicts
from proxy.sweep.verdict import Verdict

MAX_RECORDS = 200_000
# --- where the records come from -------------------------------------------------------------
def from_history(target: str, since: float, until: float | None, password: str | None = None) -> list[ResponseRecord]:
    """The records of a history (a file or a postgresql:// URL) started in [since, until)."""
    from proxy.observers.history import HistoryError, HistorySource

    source = HistorySource(target, password)
    if not source.postgres and not Path(target).exists():
        raise CliError(f"no history database at {target} (the proxy's --history)")
    try:
        backend = source.backend()
        records = list(backend.iterate(RecordQuery(since=since, until=until), MAX_RECORDS))
        if backend.skipped[0]:
            sys.stderr.write(f"llm-diag-proxy diagnose: {backend.skipped[0]} rows of the history hold no record this "
                             "version can read (another version's, or damaged): left out\n")
        return records
    except HistoryError as exc:
        raise CliError(str(exc)) from None
    except Exception as exc:  # a file that is no database, and friends: one line, not a traceback
        raise CliError(f"cannot read the history at {source.shown}: {exc}"[:400]) from None


def default_history() -> str:
    """The history of the one proxy of this user that keeps one in the default place; a clear
    error when there is none, or several to choose from."""
    from proxy.observers.history import history_files
    from proxy.observers.history.source import state_directory

    found = history_files()
    if not found:
        raise CliError(f"no proxy history in {state_directory()}: pass --history PATH|URL or --admin URL")
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:5]) + (", ..." if len(found) > 5 else "")
        raise CliError(f"{len(found)} proxies keep a history in {state_directory()} ({names}): "
                       f"pass --history with one of them, or --admin URL")
    return str(found[0])


async def proxy_url(admin: str, token: str | None) -> str | None:
    """The proxy port of the proxy whose admin listener is `admin` (its `/api/about`), or None."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session, \
                session.get(f"{admin}/api/about", headers=headers) as response:
            about = orjson.loads(await response.read()) if response.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    url = about.get("proxy", {}).get("url") if isinstance(about, dict) else None
    return url if isinstance(url, str) and url.startswith(("http://", "https://")) else None


def target_of(records: list[ResponseRecord]) -> str:
    """The proxy port that recorded most of `records`, from their `instance` (its default is the
    host name and the listen port): loopback when that host is this machine."""
    found = Counter(r.instance for r in records if r.instance)
    if found:
        host, _, port = found.most_common(1)[0][0].rpartition(":")
        if port.isdigit() and host and all(c.isalnum() or c in ".-_" for c in host):
            local = host in (socket.gethostname(), "localhost") or host.startswith("127.")
            return f"http://{'127.0.0.1' if local else host}:{port}"
    return "http://127.0.0.1:8080"


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
    from proxy.sweep.sweep_command import VERDICT_KINDS

    parser = subparsers.add_parser(
        "diagnose", help="the sweep's verdict on the proxy's records of live traffic (observational)",
        description="Groups the proxy's records of live traffic by model, budget band and the concurrency "
                    "each saw, and applies the sweep's rules: completion and output length by level, the "
                    "dominant cause and where it starts. Observational: it says when a controlled sweep is "
                    "needed to be sure.")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--history", default=None, metavar="PATH|URL",
                        help="the proxy's history: a SQLite file, or the postgresql:// URL a fleet writes to "
                             "(default: the one proxy history in ~/.local/state/llm-diag-proxy)")
    source.add_argument("--admin", type=flag_type(parse_upstream_url), default=None, metavar="URL",
                        help="a running proxy's admin URL (reads /api/requests)")
    parser.add_argument("--admin-token", default=os.environ.get("LLM_DIAG_ADMIN_TOKEN") or None,
                        help="bearer token of the admin API (env LLM_DIAG_ADMIN_TOKEN)")
    parser.add_argument("--history-password-file", default=os.environ.get("LLM_DIAG_HISTORY_PASSWORD_FILE") or None,
                        metavar="FILE", help="the PostgreSQL password, from this file's first line (PGPASSWORD works "
                                             "too)")
    parser.add_argument("--by", choices=BY, default=None,
                        help="a verdict per proxy (instance), per server (upstream) or per model, and a line that "
                             "names the one that differs from the rest")
    parser.add_argument("--since", type=flag_type(parse_duration), default=3600.0, metavar="AGE",
                        help="records of the last AGE: 30m, 1h, 1d (default 1h)")
    parser.add_argument("--model", default=None, help="only this model")
    parser.add_argument("--min-per-level", type=flag_type(parse_positive_int), default=MIN_PER_LEVEL, metavar="N",
                        help="a concurrency level needs this many records to count (default %(default)s)")
    parser.add_argument("--target", default=None, metavar="URL",
                        help="the proxy's URL, for the sweep command it suggests (default: with --admin, the port "
                             "of that proxy; with --history, the proxy named on the records)")
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
        from proxy.observers.history.source import (
            is_postgres,
            parse_history,
            password_without_database,
            read_password_file,
            shown,
        )

        try:
            target = parse_history(args.history or os.environ.get("LLM_DIAG_HISTORY") or "") or default_history()
            password = read_password_file(args.history_password_file) if args.history_password_file else None
            if password is not None and not is_postgres(target):
                raise ConfigError(password_without_database(target))
        except ConfigError as exc:
            raise CliError(str(exc)) from None
        records = from_history(target, since, None, password)
        where = shown(target)
    groups = needs_action_first(groups_of(records, model=args.model, min_per_level=args.min_per_level, by=args.by))
    admin = args.admin  # without it (a history), the suggested sweep reads its own streams
    sweep_target: str | None = args.target or (
        asyncio.run(proxy_url(args.admin, args.admin_token)) if args.admin else None)
    out = sys.stdout
    out.write(f"llm-diag-proxy diagnose: {len(records)} records since "
              f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))} from {where}\n")
    findings = timeouts.lines(records) + whose.lines(records) + live.count_lines(records)
    if not groups:
        out.write("".join(line + "\n" for line in findings))
        out.write(f"VERDICT (insufficient_data): no model and budget band has records at two concurrency levels "
                  f"with {args.min_per_level} or more each; widen --since, lower --min-per-level, or run the "
                  f"controlled sweep\n")
        return exit_code(Verdict("insufficient_data", "", None, None, False, (), ""), args.fail_on)
    code = 0
    for number, group in enumerate(groups):
        through = sweep_target or target_of([s.record for s in group.samples])
        out.write(f"\n== {group.name()}: {len(group.samples)} answers\n{table.render(group.summaries)}\n\n"
                  f"{group.verdict.text()}\n" + "\n".join(explain(group, through, admin)) + "\n")
        try:
            write_files(group, number, args, where, since)
        except OSError as exc:
            raise CliError(f"cannot write the diagnose files: {exc}") from None
        code = max(code, exit_code(group.verdict, args.fail_on, sys.stderr))
    if args.by is not None:
        out.write("\n" + "\n".join(compare(groups, args.by, records)) + "\n")
    if findings:
        out.write("\n" + "\n".join(findings) + "\n")
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

