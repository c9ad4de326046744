"""Configuration of the proxy: one frozen dataclass, the parsing of its flag values, and how a
bad value reaches the user (one line, exit code 2) in every command."""

from __future__ import annotations

import argparse
import base64
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

DEFAULT_UPSTREAM = "http://127.0.0.1:11434"  # Ollama's default
DEFAULT_LISTEN = "127.0.0.1:8080"
DEFAULT_ADMIN_LISTEN = "127.0.0.1:9464"
MAX_WORKERS = 64


T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value that cannot be used; its message is shown to the user as is."""


class CliError(Exception):
    """A user mistake found after parsing; printed as one line, exit code 2."""


def flag_type(parse: Callable[[str], T]) -> Callable[[str], T]:
    """Adapt a `ConfigError`-raising parser to argparse, keeping its message."""

    def convert(value: str) -> T:
        try:
            return parse(value)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__.removeprefix("parse_")
    return convert


@dataclass(frozen=True, slots=True)
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_host_port(value: str) -> HostPort:
    """Parse `HOST:PORT`, `[v6]:PORT` or `:PORT` (which means 127.0.0.1, the safe default)."""
    text = value.strip()
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
        if not sep:
            raise ConfigError(f"invalid address {value!r}: expected [IPv6]:PORT")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ConfigError(f"invalid address {value!r}: expected HOST:PORT")
        if ":" in host:
            raise ConfigError(f"invalid address {value!r}: write IPv6 hosts as [HOST]:PORT")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"invalid port in {value!r}: expected a number from 0 to 65535")
    return HostPort(host or "127.0.0.1", int(port_text))


def redact_url(value: str) -> str:
    """A URL as it may be shown: a password in it replaced by `***` (logs, errors, /readyz, 502 bodies)."""
    try:
        parts = urlsplit(value)
    except ValueError:
        return re.sub(r"//[^/@]*@", "//***@", value)
    if parts.password is None:
        return value
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def split_credentials(url: str) -> tuple[str, str | None]:
    """`http://user:pass@host/x` -> (`http://host/x`, the Basic `Authorization` value); no userinfo: (url, None).

    aiohttp refuses a URL with credentials beside an `Authorization` header, and a URL is shown in
    logs and answers: the proxy keeps the credentials apart and sends them as a header instead.
    """
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    userinfo = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
    token = base64.b64encode(userinfo.encode()).decode()
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2])), f"Basic {token}"


def parse_upstream_url(value: str) -> str:
    """Check an upstream base URL (`http://[user:pass@]host:port[/prefix]`) and return it without a
    trailing /. Errors show it with the password redacted."""
    text = value.strip()
    shown = redact_url(text)
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"invalid upstream URL {shown!r}: {redact_url(str(exc))}") from None
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"invalid upstream URL {shown!r}: the scheme must be http or https")
    if not parts.hostname:
        raise ConfigError(f"invalid upstream URL {shown!r}: no host")
    if parts.query or parts.fragment:
        raise ConfigError(f"invalid upstream URL {shown!r}: a query or fragment is not allowed")
    del port
    return text.rstrip("/")


def _non_negative(value: str, what: str, zero_means: str = "") -> float:
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"invalid {what} {value!r}") from None
    if not 0 <= number < float("inf"):
        raise ConfigError(f"invalid {what} {value!r}: must be 0{zero_means} or positive")
    return number


def parse_host_names(value: str) -> frozenset[str]:
    """`--admin-allowed-hosts`: comma-separated host names (lower case, no port), or `*` for any."""
    names = frozenset(part.strip().lower() for part in value.split(",") if part.strip())
    for name in names:
        if name != "*" and not re.fullmatch(r"[a-z0-9.-]{1,253}", name):
            raise ConfigError(f"invalid host name {name[:60]!r} in --admin-allowed-hosts: expected names like "
                              "proxy.example.com, comma-separated, or *")
    return names


def parse_seconds(value: str) -> float:
    """A non-negative number of seconds; 0 means off."""
    return _non_negative(value, "number of seconds", " (off)")


def parse_positive_seconds(value: str) -> float:
    """A positive number of seconds (an interval that cannot be off)."""
    seconds = parse_seconds(value)
    if seconds == 0:
        raise ConfigError(f"invalid number of seconds {value!r}: must be positive")
    return seconds


def parse_factor(value: str) -> float:
    """A non-negative finite number (a slowdown factor, a spread)."""
    return _non_negative(value, "number")


def parse_count(value: str) -> int:
    """A whole number, 0 or more (0 switches a limit off)."""
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"invalid integer {value!r}") from None
    if number < 0:
        raise ConfigError(f"invalid value {value!r}: must be 0 or more")
    return number


def parse_positive_int(value: str) -> int:
    number = parse_count(value)
    if number < 1:
        raise ConfigError(f"invalid value {value!r}: must be at least 1")
    return number


_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
               "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40}


def parse_duration(value: str) -> float:
    """`90`, `90s`, `30m`, `12h`, `7d`, `2w` -> seconds (non-negative; 0 means off)."""
    text = value.strip().lower()
    unit = text[-1:] if text[-1:] in _DURATION_UNITS else "s"
    number = text[:-1] if text[-1:] in _DURATION_UNITS else text
    try:
        seconds = float(number) * _DURATION_UNITS[unit]
    except ValueError:
        raise ConfigError(f"invalid duration {value!r}: expected a number with s, m, h, d or w") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise ConfigError(f"invalid duration {value!r}: must be 0 (off) or more")
    return seconds


def parse_positive_duration(value: str) -> float:
    """A duration that cannot be off: `0.5`, `10s`, `2m`."""
    seconds = parse_duration(value)
    if seconds == 0:
        raise ConfigError(f"invalid duration {value!r}: must be positive")
    return seconds


def parse_size(value: str) -> int:
    """`1073741824`, `500MB`, `1GiB`, `2g` -> bytes (non-negative; 0 means no limit)."""
    text = value.strip().lower().replace(" ", "")
    digits = len(text) - len(text.lstrip("0123456789."))
    unit = text[digits:]
    if not digits or unit not in _SIZE_UNITS:
        raise ConfigError(f"invalid size {value!r}: expected bytes, or a number with KiB, MiB, GiB (or KB, MB, GB)")
    try:
        return int(float(text[:digits]) * _SIZE_UNITS[unit])
    except ValueError:
        raise ConfigError(f"invalid size {value!r}") from None


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Everything `serve` needs; built from flags and environment by the CLI, or directly in tests."""

    upstream: str = DEFAULT_UPSTREAM
    listen: HostPort = HostPort("127.0.0.1", 8080)
    admin_listen: HostPort = HostPort("127.0.0.1", 9464)
    deadline_s: float = 0.0
    idle_timeout_s: float = 0.0
    deadline_mode: Literal["observe", "enforce"] = "observe"
    request_body_cap_bytes: int = 32 * 1024 * 1024
    response_body_cap_bytes: int = 32 * 1024 * 1024
    max_line_bytes: int = 4 * 1024 * 1024
    ring_size: int = 10_000
    max_models: int = 50
    log_level: str = "info"
    log_format: Literal["json", "console"] = "json"
    log_records: bool = True
    admin_token: str | None = field(default=None, repr=False)
    admin_allowed_hosts: frozenset[str] = frozenset()  # host names the admin page answers, beside IPs and localhost
    gpu_poll_interval_s: float = 1.0
    upstream_metrics: Literal["auto", "vllm", "ollama", "off"] = "auto"
    upstream_metrics_interval_s: float = 1.0
    server_tokenizer: bool = True  # ask the upstream's tokenizer when the wire leaves a length stop open
    server_traces: bool = False  # take the server's request spans at POST /v1/traces on the admin listener
    server_traces_wait_s: float = 10.0  # how long a finished record waits for its span
    # The admission gate (off unless max_in_flight is set, here or through the admin API at run time).
    max_in_flight: int | None = None
    queue_max: int = 1024
    queue_timeout_s: float | None = None
    connect_timeout_s: float = 10.0
    backlog: int = 2048  # the listen queue: a burst of connects beyond it is reset by the kernel
    header_timeout_s: float = 15.0  # a connection's time to send a whole request head (and idle keep-alive)
    shutdown_grace_s: float = 20.0  # on SIGTERM: how long open streams may still finish
    parse_bytes_max: int = 256 * 1024 * 1024  # process-wide bytes held to read bodies; beyond: unread
    workers: int = 1  # processes serving the proxy port (SO_REUSEPORT); >1: proxy/serve/workers.py
    history_path: str | None = None  # a SQLite file or a postgresql:// URL (observers/history/); None: off
    history_max_age_s: float = 7 * 86400.0
    history_max_bytes: int = 1 << 30
    history_buffer: int = 50_000  # records waiting for the history's writer; past it, counted as dropped
    history_password: str | None = field(default=None, repr=False)  # --history-password-file's
    instance: str | None = None  # this proxy's name on its records (the CLI's default: host name and port)
    client_header: str | None = None  # a header that names the client (else a keyed hash of the API key)
    client_secret: bytes | None = field(default=None, repr=False)  # the key of that hash (None: one per process)
    client_metrics: int = 0  # a bounded `client` label on llm_proxy_client_requests_total (0: no such metric)
    otel: bool = False  # OpenTelemetry spans over OTLP (proxy/observers/tracing.py), configured by the OTEL_* env
    # Credentials from the upstream URL, sent as the `Authorization` header when the client sends none;
    # never shown (the URL above has them taken out).
    upstream_authorization: str | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ConfigError(f"invalid --workers {self.workers}: expected 1 to {MAX_WORKERS}")
        clean, authorization = split_credentials(self.upstream)
        if authorization is not None:
            object.__setattr__(self, "upstream", clean)
            if self.upstream_authorization is None:
                object.__setattr__(self, "upstream_authorization", authorization)
