"""Who sent a request: the record's `client`, never a credential.

By default a short keyed hash of the API key the request carries (`Authorization: Bearer …`,
`x-api-key`, `api-key`): `key:` and 12 hex digits of HMAC-SHA256 under a secret of this
installation, so that the same key is the same client across records, restarts and (with one
secret file) a fleet, while the key cannot be found from the hash by guessing keys without the
secret. Or the value of a header the operator names (`--client-header X-Client-Id`,
`OpenAI-Project`), which names clients without being a credential. A header that carries a
credential cannot be named: the five known ones (`CREDENTIAL_HEADERS`) and any whose name holds `key`,
`token`, `secret` or `auth` (`Ocp-Apim-Subscription-Key`, `X-Auth-Token`). A header's value never
takes the keyed hashes' `key:` names: one that starts so is recorded as `header:key:…`. A request
with neither has no client (None).

The secret: `--client-secret-file FILE` (share one across a fleet, e.g. from a Kubernetes Secret),
else `client-secret` in the proxy's state directory, made at the first start (32 random bytes,
0600). One shorter than MIN_SECRET_BYTES there (empty after a crash at the first start, cut short) is
replaced once, under a lock, with one log line. Where it cannot be read or made, a secret for this
process only (the hashes then change at each restart), said once in the log. The secret is chosen
once, before any worker starts: every worker names a key alike.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

DIGITS = 12
MAX_NAME = 64
MIN_SECRET_BYTES = 16
KEY_HEADERS = ("authorization", "x-api-key", "api-key")
CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "x-api-key", "api-key", "cookie",
                                "set-cookie"})
CREDENTIAL_WORDS = ("key", "token", "secret", "auth", "password", "cookie", "session")
KEY_PREFIX = "key:"


def is_credential_header(name: str) -> bool:
    """A header that carries (or may carry) a credential: a known one, or one whose name says so."""
    lowered = name.strip().lower()
    return lowered in CREDENTIAL_HEADERS or any(word in lowered for word in CREDENTIAL_WORDS)


class ClientNamer:
    """Names the client of a request from its headers (one HMAC per request: about 2 µs)."""

    def __init__(self, secret: bytes, header: str | None = None) -> None:
        if header is not None and is_credential_header(header):
            raise ValueError(f"--client-header {header!r} is a credential: the record never holds one")
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the clients' secret holds {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed")
        self._secret = secret
        self.header = header.strip() if header else None

    def name(self, headers: Mapping[str, str]) -> str | None:
        if self.header is not None:
            value = headers.get(self.header)
            if value:
                text = "".join(c for c in value.strip()[:MAX_NAME] if c.isprintable())
                if text[:len(KEY_PREFIX)].lower() == KEY_PREFIX:  # never one of the keyed hashes' names
                    text = "header:" + text
                return text or None
        for header in KEY_HEADERS:
            value = headers.get(header)
            if value:
                key = value.strip()
                if header == "authorization":
                    scheme, _, rest = key.partition(" ")
                    key = rest.strip() if scheme.lower() in ("bearer", "basic") and rest else key
                digest = hmac.new(self._secret, key.encode("utf-8", "surrogateescape"), hashlib.sha256)
                return "key:" + digest.hexdigest()[:DIGITS]
        return None


def load_secret(path: str | None, state_directory: Path) -> tuple[bytes, str | None]:
    """The installation's secret, and a note when only a per-process one could be had."""
    if path is not None:
        given = Path(path).read_bytes().strip()  # OSError: the caller says it in one line
        if len(given) < MIN_SECRET_BYTES:
            raise ValueError(f"--client-secret-file {path} holds {len(given)} bytes; use at least "
                             f"{MIN_SECRET_BYTES} random ones")
        return given, None
    own = state_directory / "client-secret"
    stored: bytes | None
    try:
        stored = own.read_bytes()
    except FileNotFoundError:
        stored = None
    except OSError as exc:
        return secrets.token_bytes(32), f"cannot read {own}: {exc.strerror or exc}"
    if stored is not None and len(stored) >= MIN_SECRET_BYTES:
        return stored, None
    try:
        state_directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        return _made(own), None
    except OSError as exc:
        return secrets.token_bytes(32), f"cannot write {own}: {exc.strerror or exc}"


def _made(own: Path) -> bytes:
    """The installation's secret file made, or made again when it holds fewer than MIN_SECRET_BYTES,
    under a lock: proxies starting together all end up with the one secret the file holds."""
    lock = own.with_name(own.name + ".lock")
    descriptor = os.open(lock, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        found: bytes | None
        try:
            found = own.read_bytes()
        except FileNotFoundError:
            found = None
        if found is not None and len(found) >= MIN_SECRET_BYTES:
            return found  # another proxy made it meanwhile
        data = secrets.token_bytes(32)
        fresh = own.with_name(own.name + ".new")
        with os.fdopen(os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(fresh, own)
        if found is not None:
            import structlog

            structlog.get_logger("llm_diag_proxy").warning(
                "client_secret_replaced", path=str(own), bytes=len(found),
                note=f"it held fewer than {MIN_SECRET_BYTES} bytes (a first start that stopped half way?): a new "
                     "one is made; clients' names (key:…) change this once")
        return data
    finally:
        os.close(descriptor)
