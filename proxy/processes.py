"""Processes that end cleanly even when killed: a lock the kernel frees when its holder dies, and
children that die with their parent.

The lock: `multiprocessing.Lock` is a semaphore: a worker killed by SIGKILL (the OOM killer) inside its
critical section would leave it taken, and every other process would wait on it for ever. This
one is an fcntl(2) record lock on a file: the kernel drops it when its process dies, whatever
killed it. Each process opens the file itself (the lock is pickled as its path), and takes the lock
from one thread only, as the proxy's event loop does.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import signal
import tempfile
from types import TracebackType
from typing import Any

PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Slots of the state processes share (in-flight counts, parse bytes, tokenizer calls): slot 0 is a
# single process's (or the supervisor's), slot 1 + i worker i's (--workers is at most 64).
OWNERS = 65


class ProcessLock:
    """An exclusive lock across processes, released by the kernel when its holder dies."""

    def __init__(self, path: str | None = None) -> None:
        if path is None:
            descriptor, path = tempfile.mkstemp(prefix="llm-diag-proxy-", suffix=".lock")
            os.close(descriptor)
        self.path = path
        self._fd: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}  # a descriptor does not cross a process boundary: each opens its own

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self._fd = None

    def _descriptor(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        return self._fd

    def __enter__(self) -> ProcessLock:
        fcntl.lockf(self._descriptor(), fcntl.LOCK_EX)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        fcntl.lockf(self._descriptor(), fcntl.LOCK_UN)

    def remove(self) -> None:
        """Delete the lock's file (its owner, at the end)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def follow_parent(parent: int) -> None:
    """Ask the kernel for SIGTERM when the parent dies (Linux's PR_SET_PDEATHSIG), so that no child
    keeps a port open or a core busy with no one reading its results; exit at once if it died already."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)
