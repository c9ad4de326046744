"""Who sent a request: the record's `client`, never a credential.

By default a short keyed hash of the API key the request carries (`Authorization: Bearer …`,
`x-api-key`, `api-key`): `key:` and 12 hex digits of HMAC-SHA256 under a secret of this
installation, so that the same key is the same client across records, restarts and (with one
secret file) a fleet, while the key cannot be found from the hash by guessing keys without the
secret. Or the value of a header the operator names (`--client-header X-Client-Id`,
`OpenAI-Project`), which names clients without being a credential; a credential header cannot be
named. A request with neither has no client (None).

The secret: `--client-secret-file FILE` (share one across a fleet, e.g. from a Kubernetes Secret),
else `client-secret` in the proxy's state directory, made at the first start (32 random bytes,
0600). Where it cannot be read or made, a secret for this process only (the hashes then change at
each restart), said once in the log.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

DIGITS = 12
MAX_NAME = 64
KEY_HEADERS = ("authorization", "x-api-key", "api-key")
CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "x-api-key", "api-key", "cookie"})


class ClientNamer:
    """Names the client of a request from its headers (one HMAC per request: about 2 µs)."""

    def __init__(self, secret: bytes, header: str | None = None) -> None:
        if header is not None and header.strip().lower() in CREDENTIAL_HEADERS:
            raise ValueError(f"--client-header {header!r} is a credential: the record never holds one")
        self._secret = secret
        self.header = header.strip() if header else None

    def name(self, headers: Mapping[str, str]) -> str | None:
        if self.header is not None:
            value = headers.get(self.header)
            if value:
                text = "".join(c for c in value.strip()[:MAX_NAME] if c.isprintable())
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
        data = Path(path).read_bytes().strip()  # OSError: the caller says it in one line
        if len(data) < 16:
            raise ValueError(f"--client-secret-file {path} holds {len(data)} bytes; use at least 16 random ones")
        return data, None
    own = state_directory / "client-secret"
    try:
        return own.read_bytes(), None
    except FileNotFoundError:
        pass
    except OSError as exc:
        return secrets.token_bytes(32), f"cannot read {own}: {exc.strerror or exc}"
    try:
        state_directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        data = secrets.token_bytes(32)
        descriptor = os.open(own, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
        return data, None
    except FileExistsError:  # another proxy made it at the same moment
        return own.read_bytes(), None
    except OSError as exc:
        return secrets.token_bytes(32), f"cannot write {own}: {exc.strerror or exc}"
