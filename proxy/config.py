"""Configuration of the proxy: one frozen dataclass, and the parsing of its flag values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

DEFAULT_UPSTREAM = "http://127.0.0.1:11434"  # Ollama's default
DEFAULT_LISTEN = "127.0.0.1:8080"
DEFAULT_ADMIN_LISTEN = "127.0.0.1:9464"


class ConfigError(ValueError):
    """A configuration value that cannot be used; its message is shown to the user as is."""


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


def parse_upstream_url(value: str) -> str:
    """Check an upstream base URL (`http://host:port[/prefix]`) and return it without a trailing /."""
    text = value.strip()
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"invalid upstream URL {value!r}: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"invalid upstream URL {value!r}: the scheme must be http or https")
    if not parts.hostname:
        raise ConfigError(f"invalid upstream URL {value!r}: no host")
    if parts.query or parts.fragment:
        raise ConfigError(f"invalid upstream URL {value!r}: a query or fragment is not allowed")
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
    admin_token: str | None = None
    gpu_poll_interval_s: float = 1.0
    upstream_metrics: Literal["auto", "vllm", "ollama", "off"] = "auto"
    upstream_metrics_interval_s: float = 1.0
    connect_timeout_s: float = 10.0
