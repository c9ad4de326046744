"""Where a history is: a SQLite file (the default, one per proxy) or a PostgreSQL URL, and how it is shown.

The default file is keyed by the proxy's listen address and its upstream, so that two proxies on
one machine never write into, nor list, each other's records; the same proxy started again (same
address, same upstream) finds its own history. A proxy on an ephemeral port (`:0`) is keyed by
its process as well: nothing started later is the same proxy.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from proxy.config import ConfigError, redact_url

if TYPE_CHECKING:
    from proxy.observers.history.backend import Backend

POSTGRES_SCHEMES = ("postgresql", "postgres")
_OFF = ("off", "none", "")


def state_directory() -> Path:
    """$XDG_STATE_HOME/llm-diag-proxy, else ~/.local/state/llm-diag-proxy."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "llm-diag-proxy"


def default_path(listen: str = "127.0.0.1:8080", upstream: str = "http://127.0.0.1:11434") -> str:
    """The history file of the proxy on `listen` in front of `upstream`, in the state directory:
    `history-127.0.0.1-8080-to-127.0.0.1-11434.sqlite3`."""
    own = _slug(listen)
    if own.endswith("-0"):
        own += f"-pid{os.getpid()}"
    parts = urlsplit(upstream)
    theirs = _slug(("" if parts.scheme == "http" else f"{parts.scheme}-") + parts.netloc + parts.path)
    return str(state_directory() / f"history-{own}-to-{theirs[:80]}.sqlite3")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-") or "x"


def history_files() -> list[Path]:
    """The history files of the proxies of this user (the default locations), newest first."""
    directory = state_directory()
    found = [p for p in directory.glob("history*.sqlite3") if p.is_file()] if directory.is_dir() else []
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def is_postgres(target: str) -> bool:
    return target.split("://", 1)[0].lower() in POSTGRES_SCHEMES and "://" in target


def shown(target: str) -> str:
    """A target as it may be shown: a URL without its password (in the userinfo or the query)."""
    if "://" not in target:
        return target
    return re.sub(r"(?i)([?&]password=)[^&]*", r"\1***", redact_url(target))


def password_without_database(target: str) -> str:
    """What is wrong with --history-password-file beside a history that is a file."""
    return (f"--history-password-file is the password of a PostgreSQL history (--history postgresql://...); "
            f"the history here is the file {target}: nothing would read it")


def parse_history(value: str) -> str | None:
    """`--history`: `off`, a file path, or a postgresql:// URL (checked here: a URL never becomes
    a file path, and a wrong one is said with its password hidden)."""
    text = value.strip()
    if text.lower() in _OFF:
        return None
    if "://" not in text:
        return text
    if not is_postgres(text):
        scheme = text.split("://", 1)[0]
        raise ConfigError(f"invalid --history {shown(text)!r}: a URL must be postgresql:// (not {scheme}://); "
                          f"anything else is a file path")
    try:
        from psycopg.conninfo import conninfo_to_dict
    except ImportError:  # pragma: no cover - psycopg is a dependency
        raise ConfigError("--history postgresql://... needs psycopg: pip install 'psycopg[binary]'") from None
    try:
        for host_port in urlsplit(text).netloc.rpartition("@")[2].split(","):  # libpq checks a port only later
            after_host = host_port.rpartition("]")[2]
            port = after_host.rpartition(":")[2] if ":" in after_host else ""
            if port and not (port.isdigit() and 0 < int(port) < 65536):
                raise ValueError(f"invalid port {port!r}")
        conninfo_to_dict(text)
    except Exception as exc:  # psycopg.ProgrammingError: libpq could not parse it
        detail = " ".join(str(exc).split())[:200]
        raise ConfigError(f"invalid --history URL {shown(text)!r}: {shown(detail)}") from None
    return text


def read_password_file(path: str) -> str:
    """The password in a file (its first line), for `--history-password-file`."""
    try:
        with open(path, encoding="utf-8") as handle:
            password = handle.readline().rstrip("\r\n")
    except OSError as exc:
        raise ConfigError(f"cannot read --history-password-file {path}: {exc.strerror or exc}") from None
    if not password:
        raise ConfigError(f"--history-password-file {path} is empty")
    return password


@dataclass(frozen=True, slots=True)
class HistorySource:
    """A history to open: its target and, for PostgreSQL, a password kept apart (never shown)."""

    target: str
    password: str | None = field(default=None, repr=False)

    @property
    def shown(self) -> str:
        return shown(self.target)

    @property
    def postgres(self) -> bool:
        return is_postgres(self.target)

    @property
    def retention_every_s(self) -> float:
        """How often the writer runs retention: a fleet's database is shared by every proxy."""
        return 60.0 if self.postgres else 10.0

    def backend(self, **options: Any) -> Backend:
        if self.postgres:
            from proxy.observers.history.postgres import PostgresBackend

            return PostgresBackend(self.target, self.password)
        from proxy.observers.history.sqlite import SQLiteBackend

        return SQLiteBackend(self.target, **options)

    def __repr__(self) -> str:
        return f"HistorySource({self.shown!r})"
