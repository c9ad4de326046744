"""`llm-diag-proxy simulate`: run the inference-server simulator from the command line.

A scenario gives the starting configuration; every flag given explicitly overrides it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from dataclasses import replace
from typing import Any

from proxy.config import (
    ConfigError,
    HostPort,
    flag_type,
    parse_count,
    parse_factor,
    parse_host_port,
    parse_positive_int,
    parse_seconds,
)
from proxy.simulator.settings import KV_POLICIES, SCENARIOS, SimulatorConfig

DEFAULT_LISTEN = "127.0.0.1:11500"
DEFAULT_SCENARIO = "clamp"


# flag -> (SimulatorConfig field, parser, metavar, help)
_FLAGS: tuple[tuple[str, str, Any, str, str], ...] = (
    ("--model", "model", str, "NAME", "model name served on both APIs"),
    ("--kv-blocks", "kv_blocks", parse_count, "N", "KV-cache blocks shared by all sequences, 0 = unlimited"),
    ("--block-size", "block_size", parse_positive_int, "TOKENS", "tokens per KV block"),
    ("--kv-policy", "kv_policy", None, "POLICY", "when the KV blocks run out: clamp (lower the budget of "
                                                 "new requests), preempt (pause and recompute), reject "
                                                 "(refuse with --reject-status), none (no KV limit)"),
    ("--slots", "slots", parse_count, "N", "llama.cpp-style parallel slots, each with ctx-size/N tokens; "
                                          "0 = off"),
    ("--ctx-size", "ctx_size", parse_positive_int, "TOKENS", "model context (prompt + answer)"),
    ("--deadline", "deadline_s", parse_seconds, "SECONDS", "hidden server deadline per request: "
                                                                  "the answer ends as if complete; 0 = off"),
    ("--token-time", "token_time_s", parse_seconds, "SECONDS", "decode step time of a batch of one"),
    ("--batch-slowdown", "batch_slowdown", parse_factor, "A", "step = token-time * (1 + A * (batch - 1))"),
    ("--prefill-time", "prefill_time_per_token_s", parse_seconds, "SECONDS", "prefill time per "
                                                                                  "prompt token"),
    ("--natural-tokens", "natural_tokens", parse_positive_int, "MEAN", "mean length of an answer that ends "
                                                                   "on its own"),
    ("--natural-spread", "natural_spread", parse_factor, "FRACTION", "natural lengths vary uniformly by "
                                                                     "this fraction of the mean (<1)"),
    ("--seed", "seed", parse_count, "N", "seed for requests that bring none"),
    ("--max-num-seqs", "max_num_seqs", parse_positive_int, "N", "most sequences in one batch"),
    ("--reject-status", "reject_status", parse_positive_int, "CODE", "status of a rejected request: 429 or 503"),
)


def register(subparsers: Any) -> None:
    """Add `simulate` to the CLI (called by proxy.serve.cli.build_parser)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "simulate", help="run a simulated inference server (vLLM and Ollama APIs, no GPU)",
        description="A simulated memory-bound inference server that speaks vLLM's OpenAI API and "
                    "Ollama's API, and ends answers early the way real servers do under load.")
    parser.add_argument("--listen", type=flag_type(parse_host_port), default=DEFAULT_LISTEN,
                        help="HOST:PORT to listen on (default %(default)s)")
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default=DEFAULT_SCENARIO,
                        help="preset for one mechanism; flags below override it (default %(default)s)")
    for flag, field_name, parse, metavar, text in _FLAGS:
        if field_name == "kv_policy":
            parser.add_argument(flag, dest=field_name, choices=KV_POLICIES, default=None, help=text)
        else:
            parser.add_argument(flag, dest=field_name, type=flag_type(parse) if parse is not str else str,
                                default=None, metavar=metavar, help=text)
    parser.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> SimulatorConfig:
    """The scenario's config with the explicitly given flags applied; ConfigError if invalid."""
    overrides = {name: getattr(args, name) for _, name, *_ in _FLAGS if getattr(args, name, None) is not None}
    return replace(SCENARIOS[args.scenario], **overrides)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"llm-diag-proxy: error: {exc}", file=sys.stderr)
        return 2
    listen: HostPort = args.listen if isinstance(args.listen, HostPort) else parse_host_port(args.listen)
    try:
        asyncio.run(_serve(config, listen, args.scenario))
    except OSError as exc:
        print(f"llm-diag-proxy: error: cannot listen on {listen}: {exc.strerror or exc}", file=sys.stderr)
        return 2  # as serve does: the --listen value cannot be used
    return 0


async def _serve(config: SimulatorConfig, listen: HostPort, scenario: str) -> None:
    from proxy.simulator.server import start_simulator  # late: keeps `--help` fast

    simulator = await start_simulator(config, listen.host, listen.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    print(f"llm-diag-proxy simulate: scenario {scenario}, model {config.model}, listening on "
          f"{simulator.url} (OpenAI API under /v1, Ollama API under /api, vLLM metrics at /metrics)",
          file=sys.stderr, flush=True)
    try:
        await stop.wait()
    finally:
        await simulator.close()
