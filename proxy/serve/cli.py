"""The `llm-diag-proxy` command line: `serve` (the default), `simulate`, `sweep`, `demo`.

Every mistake in a flag ends in one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, TypeVar

from proxy import __version__
from proxy.config import (
    DEFAULT_ADMIN_LISTEN,
    DEFAULT_LISTEN,
    DEFAULT_UPSTREAM,
    CliError,
    ConfigError,
    HostPort,
    ProxyConfig,
    flag_type,
    parse_count,
    parse_duration,
    parse_host_names,
    parse_host_port,
    parse_positive_duration,
    parse_positive_int,
    parse_positive_seconds,
    parse_seconds,
    parse_size,
    parse_upstream_url,
    split_credentials,
)

PROG = "llm-diag-proxy"

# Modules that add a subcommand through `register(subparsers)`; serve is defined here.
SUBCOMMAND_MODULES = ("proxy.simulator.simulate_command", "proxy.sweep.sweep_command", "proxy.sweep.diagnose_command",
                      "proxy.serve.demo")
T = TypeVar("T")


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (`llm-diag-proxy: error: ...`) and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {message} (see '{self.prog} --help')\n")


def env_default(name: str, fallback: T = None) -> str | T:  # type: ignore[assignment]
    """A flag's default from the environment (an empty variable counts as unset)."""
    return os.environ.get(name) or fallback


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `serve`; `demo` reuses them for the proxy it starts."""
    parser.add_argument("--upstream", type=flag_type(parse_upstream_url), metavar="URL",
                        default=env_default("LLM_DIAG_UPSTREAM", DEFAULT_UPSTREAM),
                        help="base URL of the inference server (env LLM_DIAG_UPSTREAM; default %(default)s)")
    parser.add_argument("--listen", type=flag_type(parse_host_port), metavar="HOST:PORT",
                        default=env_default("LLM_DIAG_LISTEN", DEFAULT_LISTEN),
                        help="HOST:PORT where clients connect (env LLM_DIAG_LISTEN; default %(default)s)")
    parser.add_argument("--admin-listen", type=flag_type(parse_host_port), metavar="HOST:PORT",
                        default=env_default("LLM_DIAG_ADMIN_LISTEN", DEFAULT_ADMIN_LISTEN),
                        help="HOST:PORT for /metrics, /healthz, /readyz, /api/requests "
                             "(env LLM_DIAG_ADMIN_LISTEN; default %(default)s)")
    parser.add_argument("--deadline", type=flag_type(parse_seconds), default=0.0, metavar="SECONDS",
                        help="total time allowed per response, 0 = off (default)")
    parser.add_argument("--idle-timeout", type=flag_type(parse_seconds), default=0.0, metavar="SECONDS",
                        help="longest allowed gap between upstream chunks, 0 = off (default)")
    parser.add_argument("--deadline-mode", choices=("observe", "enforce"), default="observe",
                        help="observe: only record a passed deadline (default); enforce: end the "
                             "response with a visible error event")
    parser.add_argument("--ring-size", type=flag_type(parse_positive_int), default=10_000, metavar="N",
                        help="records kept in memory for /api/requests (default %(default)s)")
    parser.add_argument("--max-models", type=flag_type(parse_positive_int), default=50, metavar="N",
                        help="distinct model label values before the rest become 'other' (default %(default)s)")
    parser.add_argument("--request-body-cap", type=flag_type(parse_positive_int), default=32 * 1024 * 1024,
                        metavar="BYTES", help="largest request body parsed for diagnosis; larger ones pass "
                                              "through unparsed (default 32 MiB)")
    parser.add_argument("--admin-token", metavar="TOKEN", default=env_default("LLM_DIAG_ADMIN_TOKEN"),
                        help="require 'Authorization: Bearer TOKEN' on the admin API's /api/* "
                             "(env LLM_DIAG_ADMIN_TOKEN; default: no token)")
    parser.add_argument("--admin-allowed-hosts", type=flag_type(parse_host_names),
                        default=env_default("LLM_DIAG_ADMIN_ALLOWED_HOSTS", ""), metavar="NAMES",
                        help="host names the admin page and record API answer to, comma-separated, beside IP "
                             "addresses and localhost (env LLM_DIAG_ADMIN_ALLOWED_HOSTS; * for any): any other "
                             "Host is refused, so a web page that rebinds its name to the proxy finds nothing")
    parser.add_argument("--gpu-poll-interval", type=flag_type(parse_seconds), default=1.0, metavar="SECONDS",
                        help="NVML sampling interval, 0 = off (default %(default)s)")
    parser.add_argument("--upstream-metrics", choices=("auto", "vllm", "ollama", "off"), default="auto",
                        help="poll the upstream's own state: vLLM /metrics or Ollama /api/ps (default auto)")
    parser.add_argument("--upstream-metrics-interval", type=flag_type(parse_positive_seconds), default=1.0,
                        metavar="SECONDS", help="how often the upstream's state is read (default %(default)s; "
                                                "--upstream-metrics off turns it off)")
    parser.add_argument("--server-tokenizer", choices=("on", "off"),
                        default=env_default("LLM_DIAG_SERVER_TOKENIZER", "on"),
                        help="for a length stop whose tokens were only counted (no usage on the wire), ask the "
                             "upstream's own tokenizer for the prompt's count, after the response (default on; env "
                             "LLM_DIAG_SERVER_TOKENIZER)")
    parser.add_argument("--server-traces", choices=("on", "off"),
                        default=env_default("LLM_DIAG_SERVER_TRACES", "off"),
                        help="take the server's own request spans at POST /v1/traces on the admin listener (start "
                             "vLLM with --otlp-traces-endpoint http://ADMIN/v1/traces and "
                             "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf) and join each to its record: the "
                             "server's token counts, queue time and end decide what the wire leaves open "
                             "(default off; env LLM_DIAG_SERVER_TRACES)")
    parser.add_argument("--server-traces-wait", type=flag_type(parse_positive_duration), default=10.0,
                        metavar="DURATION",
                        help="how long a finished answer waits for the server's span before it is recorded "
                             "without it (default 10s: vLLM's exporter sends every 5 s unless "
                             "OTEL_BSP_SCHEDULE_DELAY says less)")
    parser.add_argument("--max-in-flight", type=flag_type(parse_positive_int), default=None, metavar="N",
                        help="the admission gate, off by default: at most N generations in flight to the upstream; "
                             "the rest wait in a queue fair across clients (settable at run time: PUT "
                             "/api/admission on the admin listener)")
    parser.add_argument("--queue-max", type=flag_type(parse_positive_int), default=1024, metavar="N",
                        help="with the gate: at most N generations waiting; past it a 503 with Retry-After "
                             "(default %(default)s)")
    parser.add_argument("--queue-timeout", type=flag_type(parse_positive_duration), default=None, metavar="DURATION",
                        help="with the gate: the longest a generation waits for its place, then a 503 with "
                             "Retry-After (default: as long as it takes)")
    parser.add_argument("--backlog", type=flag_type(parse_positive_int), default=2048, metavar="N",
                        help="listen queue of the proxy port: connections accepted in a burst before the kernel "
                             "resets new ones (default %(default)s; the kernel's somaxconn caps it)")
    parser.add_argument("--header-timeout", type=flag_type(parse_positive_seconds), default=15.0,
                        metavar="SECONDS", help="time a connection has to send a whole request head, at its start "
                                                "and between keep-alive requests (default %(default)s)")
    parser.add_argument("--shutdown-grace", type=flag_type(parse_seconds), default=20.0, metavar="SECONDS",
                        help="on SIGTERM, how long open streams may still finish before the proxy ends them "
                             "visibly and exits (default %(default)s; keep it under your orchestrator's grace)")
    parser.add_argument("--parse-bytes", "--parse-budget", dest="parse_bytes", type=flag_type(parse_positive_int),
                        default=256 * 1024 * 1024, metavar="BYTES",
                        help="bytes held at once, over all requests, to read request and JSON response bodies; "
                             "beyond it bodies pass unread (default 256 MiB; --parse-budget is its old name)")
    parser.add_argument("--history", default=env_default("LLM_DIAG_HISTORY"), metavar="PATH|URL|off",
                        help="keep every record across restarts: a SQLite file, or postgresql://USER@HOST/DB for one "
                             "database shared by a fleet of proxies (env LLM_DIAG_HISTORY; default a file per proxy, "
                             "keyed by its listen address and upstream, in ~/.local/state/llm-diag-proxy; "
                             "off: memory only)")
    parser.add_argument("--history-password-file", default=env_default("LLM_DIAG_HISTORY_PASSWORD_FILE"),
                        metavar="FILE", help="the PostgreSQL password, read from this file's first line (env "
                                             "LLM_DIAG_HISTORY_PASSWORD_FILE; PGPASSWORD and ~/.pgpass work too)")
    parser.add_argument("--history-buffer", type=flag_type(parse_positive_int), default=50_000, metavar="N",
                        help="records that wait for the history while it is slow or down; past them records are "
                             "counted as dropped (default %(default)s)")
    parser.add_argument("--client-header", default=env_default("LLM_DIAG_CLIENT_HEADER"), metavar="NAME",
                        help="a request header that names the client (X-Client-Id, OpenAI-Project) for the record's "
                             "`client`; default: a keyed hash of the request's API key, never the key")
    parser.add_argument("--client-secret-file", default=env_default("LLM_DIAG_CLIENT_SECRET_FILE"),
                        metavar="FILE", help="the key of that hash (share one across a fleet so a client is the same "
                                             "everywhere; default: made once in ~/.local/state/llm-diag-proxy)")
    parser.add_argument("--client-metrics", type=flag_type(parse_count), default=0, metavar="N",
                        help="count requests by client in llm_proxy_client_requests_total, the first N clients "
                             "by name and the rest as `other` (default 0: no per-client metric)")
    parser.add_argument("--instance", default=env_default("LLM_DIAG_INSTANCE"), metavar="NAME",
                        help="this proxy's name on its records, to tell replicas apart in a shared history "
                             "(env LLM_DIAG_INSTANCE; default HOSTNAME:PORT of --listen)")
    parser.add_argument("--history-max-age", type=flag_type(parse_duration), default=7 * 86400.0, metavar="AGE",
                        help="drop history older than this: 90s, 30m, 12h, 7d (default 7d; 0 keeps all)")
    parser.add_argument("--history-max-bytes", type=flag_type(parse_size), default=1 << 30, metavar="SIZE",
                        help="drop the oldest history past this size: 500MiB, 1GiB (default 1GiB; 0: no limit)")
    parser.add_argument("--otel", action="store_true",
                        help="export one OpenTelemetry span per response over OTLP (endpoint, protocol and service "
                             "name from OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_PROTOCOL, OTEL_SERVICE_NAME)")
    parser.add_argument("--workers", type=flag_type(parse_positive_int), default=1, metavar="N",
                        help="processes serving the proxy port (SO_REUSEPORT), when one core is not enough; "
                             "counts, metrics and records stay proxy-wide (default %(default)s)")
    parser.add_argument("--no-log-records", dest="log_records", action="store_false",
                        help="do not write the one JSON line per response to stdout")
    add_logging_arguments(parser)


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    parser.add_argument("--log-format", choices=("json", "console"),
                        default="console" if sys.stdout.isatty() else "json",
                        help="json (the default when stdout is not a terminal) or console")


def history_path(value: str | None, listen: HostPort | None = None, upstream: str = DEFAULT_UPSTREAM) -> str | None:
    """`--history`: `off`, a file, a postgresql:// URL, or unset: the default file of the proxy on
    `listen` in front of `upstream` (one file per proxy: two never mix their records)."""
    from proxy.observers.history import default_path, parse_history

    if value is None:
        return default_path(str(listen or parse_host_port(DEFAULT_LISTEN)), upstream)
    return parse_history(value)


def client_naming(args: argparse.Namespace) -> tuple[str | None, bytes | None]:
    """`--client-header` (never a credential) and the secret of the API keys' hash (a note in the
    log when only one for this process could be had)."""
    from proxy.diagnosis.clients import is_credential_header, load_secret
    from proxy.observers.history.source import state_directory
    from proxy.relay.http1 import is_field_name

    header = (getattr(args, "client_header", None) or "").strip() or None
    if header is not None and not is_field_name(header):
        raise ConfigError(f"invalid --client-header {header!r}: not a header name (letters, digits and "
                          "!#$%&'*+-.^_`|~ only, RFC 9110 section 5.1): no request could carry it")
    if header is not None and is_credential_header(header):
        raise ConfigError(f"invalid --client-header {header!r}: a credential never goes into a record (a header whose "
                          "name holds key, token, secret, auth, password, cookie or session may carry one); name a "
                          "header that names the client (X-Client-Id, OpenAI-Project), or leave it unset for a keyed "
                          "hash of the API key")
    path = getattr(args, "client_secret_file", None)
    try:
        secret, note = load_secret(path, state_directory())
    except (OSError, ValueError) as exc:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"cannot use --client-secret-file {path}: {detail}") from None
    if note is not None:
        import structlog

        structlog.get_logger("llm_diag_proxy").warning(
            "client_secret_per_process", error=note,
            note="clients are hashed with a key of this process: the same API key gets another name after a restart")
    return header, secret


def default_instance(listen: HostPort) -> str:
    """HOSTNAME:PORT: in Kubernetes the pod's name, and on one machine the proxy's own port."""
    import socket

    return f"{socket.gethostname()}:{listen.port if listen.port else f'pid{os.getpid()}'}"


def _on_off(value: str, flag: str) -> bool:
    """`on` or `off` (an environment default is checked here: argparse checks only flags)."""
    text = value.strip().lower()
    if text not in ("on", "off"):
        raise ConfigError(f"invalid {flag} {value!r}: expected on or off")
    return text == "on"


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """The ProxyConfig named by serve's flags (defaults from the environment are parsed here too)."""
    from proxy.observers.history.source import is_postgres, password_without_database, read_password_file

    try:
        upstream = parse_upstream_url(args.upstream)
        listen = args.listen if not isinstance(args.listen, str) else parse_host_port(args.listen)
        password_file = getattr(args, "history_password_file", None)
        instance = (getattr(args, "instance", None) or "").strip()
        if len(instance) > 200:
            raise ConfigError("invalid --instance: at most 200 characters")
        client_header, client_secret = client_naming(args)
        history = history_path(getattr(args, "history", "off"), listen, split_credentials(upstream)[0])
        if password_file and history is not None and not is_postgres(history):  # (off: the history left out)
            raise ConfigError(password_without_database(history))
        if getattr(args, "max_in_flight", None) is not None and getattr(args, "workers", 1) > 1:
            raise ConfigError("--max-in-flight needs one process: the gate's queue is not shared between "
                              "--workers yet")
        return ProxyConfig(
            upstream=upstream,
            listen=listen,
            admin_listen=(args.admin_listen if not isinstance(args.admin_listen, str)
                          else parse_host_port(args.admin_listen)),
            deadline_s=args.deadline,
            idle_timeout_s=args.idle_timeout,
            deadline_mode=args.deadline_mode,
            ring_size=args.ring_size,
            max_models=args.max_models,
            request_body_cap_bytes=args.request_body_cap,
            admin_token=args.admin_token,
            admin_allowed_hosts=(args.admin_allowed_hosts if not isinstance(args.admin_allowed_hosts, str)
                                 else parse_host_names(args.admin_allowed_hosts)),
            gpu_poll_interval_s=args.gpu_poll_interval,
            upstream_metrics=args.upstream_metrics,
            upstream_metrics_interval_s=args.upstream_metrics_interval,
            server_tokenizer=_on_off(getattr(args, "server_tokenizer", "on"), "--server-tokenizer"),
            server_traces=_on_off(getattr(args, "server_traces", "off"), "--server-traces"),
            server_traces_wait_s=getattr(args, "server_traces_wait", 10.0),
            max_in_flight=getattr(args, "max_in_flight", None),
            queue_max=getattr(args, "queue_max", 1024),
            queue_timeout_s=getattr(args, "queue_timeout", None),
            log_records=args.log_records,
            backlog=args.backlog,
            header_timeout_s=args.header_timeout,
            shutdown_grace_s=args.shutdown_grace,
            parse_bytes_max=args.parse_bytes,
            workers=getattr(args, "workers", 1),
            otel=getattr(args, "otel", False),
            history_path=history,
            history_max_age_s=getattr(args, "history_max_age", 7 * 86400.0),
            history_max_bytes=getattr(args, "history_max_bytes", 1 << 30),
            history_buffer=getattr(args, "history_buffer", 50_000),
            history_password=read_password_file(password_file) if password_file else None,
            instance=instance or default_instance(listen),
            client_header=client_header,
            client_secret=client_secret,
            client_metrics=getattr(args, "client_metrics", 0),
            log_level=args.log_level,
            log_format=args.log_format,
        )
    except ConfigError as exc:
        raise CliError(str(exc)) from None


def run_serve(args: argparse.Namespace) -> int:
    """One process, or a supervisor and N workers (`--workers`): nothing below knows which runs."""
    from proxy.observers.logs import configure_logging  # imported late: keeps `--help` fast

    config = config_from_args(args)
    configure_logging(config.log_level, config.log_format)
    if config.workers > 1:
        from proxy.serve.workers import serve_workers

        return serve_workers(config)
    from proxy.serve.app import serve_forever

    return serve_forever(config)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description="A transparent diagnostic reverse proxy for LLM "
                                                  "inference servers: records why every response ended.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    serve = subparsers.add_parser("serve", help="run the proxy (the default command)")
    add_serve_arguments(serve)
    serve.set_defaults(func=run_serve)
    for name in SUBCOMMAND_MODULES:
        try:
            module: Any = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not name.startswith(exc.name):
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    commands = {"serve", "simulate", "sweep", "diagnose", "demo"}
    if not arguments or (arguments[0] not in commands and arguments[0] not in ("-h", "--help", "--version")):
        arguments.insert(0, "serve")
    args = parser.parse_args(arguments)
    try:
        result: int = args.func(args)
    except CliError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return result
