"""Which local processes serve the upstream: the pid listening on its port, and its descendants.

Used only to attribute a response to the GPU those processes run on (vLLM's engine core and
Ollama's runner are child processes of the listening server). Linux procfs only; where it
cannot be read (another user without privileges, another pid namespace) the answer is empty
and attribution falls back to the other rules.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from urllib.parse import urlsplit

_TCP_LISTEN = "0A"  # st column of /proc/net/tcp: include/net/tcp_states.h, TCP_LISTEN = 10


def local_port(upstream: str) -> int | None:
    """The upstream's port when its host is this machine's loopback, else None."""
    parts = urlsplit(upstream)
    host = parts.hostname or ""
    if host != "localhost":
        try:
            if not ipaddress.ip_address(host).is_loopback:
                return None
        except ValueError:
            return None
    try:
        port = parts.port
    except ValueError:
        return None
    return port if port is not None else (443 if parts.scheme == "https" else 80)


def listening_inodes(tcp_table: str, port: int) -> set[int]:
    """Socket inodes in LISTEN state on `port`, from the text of /proc/net/tcp or tcp6."""
    inodes: set[int] = set()
    for line in tcp_table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] != _TCP_LISTEN:
            continue
        _, _, port_hex = fields[1].rpartition(":")
        try:
            if int(port_hex, 16) == port:
                inodes.add(int(fields[9]))
        except ValueError:
            continue
    return inodes


def parent_of(stat_line: str) -> int | None:
    """The ppid in a /proc/<pid>/stat line; the comm field may hold spaces and parentheses."""
    _, sep, rest = stat_line.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) < 2:
        return None
    try:
        return int(fields[1])
    except ValueError:
        return None


def with_descendants(parents: Mapping[int, int], roots: Iterable[int]) -> frozenset[int]:
    """`roots` and every process whose chain of parents leads to one of them."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    stack = list(roots)
    while stack:
        pid = stack.pop()
        if pid in found:
            continue
        found.add(pid)
        stack.extend(children.get(pid, ()))
    return frozenset(found)


def _pids(proc: Path) -> list[int]:
    try:
        return [int(e.name) for e in os.scandir(proc) if e.name.isdigit()]
    except OSError:
        return []


def upstream_pids(upstream: str, proc: Path = Path("/proc")) -> frozenset[int]:
    """The pids serving `upstream` on this machine, with their descendants; empty if unknown.

    Blocking (reads procfs): call it off the event loop.
    """
    port = local_port(upstream)
    if port is None:
        return frozenset()
    inodes: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            inodes |= listening_inodes((proc / "net" / table).read_text(), port)
        except OSError:
            continue
    if not inodes:
        return frozenset()
    wanted = {f"socket:[{inode}]" for inode in inodes}
    roots: set[int] = set()
    parents: dict[int, int] = {}
    for pid in _pids(proc):
        try:
            ppid = parent_of((proc / str(pid) / "stat").read_text(errors="replace"))
        except OSError:
            continue
        if ppid is not None:
            parents[pid] = ppid
        try:
            fds = os.scandir(proc / str(pid) / "fd")
        except OSError:
            continue
        with fds:
            for fd in fds:
                try:
                    if os.readlink(fd.path) in wanted:
                        roots.add(pid)
                        break
                except OSError:
                    continue
    return with_descendants(parents, roots) if roots else frozenset()
