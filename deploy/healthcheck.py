"""Container health check: GET /healthz on the proxy's admin listener; exit 0 if it answers 200.

Python rather than curl so the slim image needs nothing more. The address comes from
LLM_DIAG_ADMIN_LISTEN (or the first argument); a wildcard bind (0.0.0.0, ::) is probed on loopback.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

WILDCARD_TO_LOOPBACK = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}


def healthz_url(listen: str) -> str:
    """The /healthz URL for an admin `HOST:PORT`, `[v6]:PORT` or `:PORT`."""
    if listen.startswith("["):
        host, _, port = listen[1:].partition("]:")
    else:
        host, _, port = listen.rpartition(":")
    host = WILDCARD_TO_LOOPBACK.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/healthz"


def main(argv: list[str]) -> int:
    listen = argv[1] if len(argv) > 1 else os.environ.get("LLM_DIAG_ADMIN_LISTEN", "127.0.0.1:9464")
    url = healthz_url(listen)
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            status = response.status
    except (urllib.error.URLError, OSError) as exc:
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"unhealthy: {url}: HTTP {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
