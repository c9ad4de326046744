"""Jobs for the admin reader process in tests: module-level, so that they reach it by name."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import orjson

from proxy.observers.history import HistoryReadError


def sleep(seconds: float, tag: str) -> bytes:
    time.sleep(seconds)
    return orjson.dumps({"tag": tag, "pid": os.getpid()})


def where() -> bytes:
    return orjson.dumps({"pid": os.getpid(), "ppid": os.getppid(), "nice": os.nice(0)})


def broken_history() -> bytes:
    """As the SQLite backend says a corrupt file (its sqlite3.Error, in the backend's words)."""
    raise HistoryReadError("cannot read the history at /x/history.sqlite3: database disk image is malformed")


def bug() -> bytes:
    raise KeyError("secret-looking-key")


def die() -> bytes:
    os._exit(9)


JOBS: dict[str, Callable[..., bytes]] = {
    "sleep": sleep, "where": where, "broken_history": broken_history, "bug": bug, "die": die}
