"""`llm-diag-proxy demo`: the simulator, the proxy in front of it, and a short sweep, in one process.

What the simulator was set to do stays hidden from the sweep: the verdict comes only from what
the proxy recorded, so the demo shows a real diagnosis, not a replayed one.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import replace
from typing import Any

from proxy.config import CliError, flag_type, parse_host_port
from proxy.serve.cli import add_serve_arguments, config_from_args
from proxy.simulator.settings import SCENARIOS
from proxy.simulator.simulate_command import DEFAULT_SCENARIO
from proxy.sweep.session import execute, exit_code
from proxy.sweep.sweep_command import add_sweep_arguments, plan_from_args
from proxy.sweep.verdict import Verdict

DEMO_MAX_TOKENS = 128  # the simulator's presets are sized for this budget


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo", help="simulator + proxy + a short sweep: a real diagnosis in seconds, no GPU needed",
        description="Starts the built-in simulator, the proxy in front of it and a short concurrency "
                    "sweep through the proxy; prints the table and the verdict.")
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default=DEFAULT_SCENARIO,
                        help="what the simulated server does under load (default %(default)s)")
    parser.add_argument("--simulator-listen", type=flag_type(parse_host_port), default="127.0.0.1:0",
                        metavar="HOST:PORT", help="where the simulator listens (default: a free port)")
    parser.add_argument("--keep-running", action="store_true",
                        help="leave simulator and proxy up after the sweep (look at /metrics); Ctrl-C ends")
    add_serve_arguments(parser)
    add_sweep_arguments(parser)
    # The simulator is the upstream; the demo's own listeners take free ports unless told otherwise.
    parser.set_defaults(listen="127.0.0.1:0", admin_listen="127.0.0.1:0", log_level="warning",
                        upstream="http://127.0.0.1:1", history="off", repeats=3, max_tokens=DEMO_MAX_TOKENS,
                        timeout=30.0,
                        out_dir=None, func=run)
    for action in parser._actions:  # argparse has no public way to hide an inherited flag
        if action.dest == "upstream":
            action.help = argparse.SUPPRESS


async def demo(args: argparse.Namespace) -> Verdict:
    """Start simulator and proxy, sweep through the proxy, print; stop them unless --keep-running."""
    from proxy.observers.logs import configure_logging
    from proxy.serve.app import start_proxy
    from proxy.simulator import start_simulator

    configure_logging(args.log_level, args.log_format, stream=sys.stderr)
    simulator_config = SCENARIOS[args.scenario]
    where = args.simulator_listen
    try:
        simulator = await start_simulator(simulator_config, where.host, where.port)
    except OSError as exc:
        raise CliError(f"cannot start the simulator on {where}: {exc.strerror or exc}") from None
    try:
        config = replace(config_from_args(args), upstream=simulator.url)
        try:
            proxy = await start_proxy(config, log_records=False)
        except OSError as exc:
            raise CliError(f"cannot start the proxy: {exc.strerror or exc}") from None
        try:
            plan = plan_from_args(args, proxy.proxy_url, proxy.admin_url, simulator_config.model)
            print(f"llm-diag-proxy demo: simulator (scenario '{args.scenario}', hidden from the sweep) at "
                  f"{simulator.url}\n  proxy at {proxy.proxy_url}, admin at {proxy.admin_url}\n"
                  f"  sweep: concurrency {','.join(map(str, plan.levels))}, {plan.repeats} requests per slot, "
                  f"max_tokens {plan.max_tokens}, seed {plan.seed}\n", flush=True)
            outcome = await execute(plan, out_dir=args.out_dir, report_path=args.report,
                                    progress=not args.no_progress)
            own = ("your own server: llm-diag-proxy serve --upstream URL, then llm-diag-proxy sweep --target "
                   "http://127.0.0.1:8080 --admin http://127.0.0.1:9464 --model NAME")
            if not args.keep_running:  # the listeners close with the demo: no address to visit is shown
                print(f"\nthe demo's simulator and proxy stop now; to look at their /metrics, records and page "
                      f"afterwards, run it with --keep-running\n{own}", flush=True)
                return outcome.verdict
            print(f"\n--keep-running: the simulator and the proxy stay up until Ctrl-C\n"
                  f"  page:    {proxy.admin_url}/\n  metrics: {proxy.admin_url}/metrics\n"
                  f"  records: {proxy.admin_url}/api/requests?limit=20\n  proxy:   {proxy.proxy_url} "
                  f"(send your own requests, model {simulator_config.model})\n{own}", flush=True)
            await asyncio.Event().wait()
            return outcome.verdict
        finally:
            await proxy.close()
    finally:
        await simulator.close()


def run(args: argparse.Namespace) -> int:
    try:
        verdict = asyncio.run(demo(args))
    except KeyboardInterrupt:
        return 0 if args.keep_running else 130
    return exit_code(verdict, args.fail_on)
