"""A lock that worker processes share and that a killed process cannot leave held.

`multiprocessing.Lock` is a semaphore: a worker killed by SIGKILL (the OOM killer) inside its
critical section would leave it taken, and every other process would wait on it for ever. This
one is an fcntl(2) record lock on a file: the kernel drops it when its process dies, whatever
killed it. Each process opens the file itself (the lock is pickled as its path), and takes the lock
from one thread only, as the proxy's event loop does.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from types import TracebackType
from typing import Any


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
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
