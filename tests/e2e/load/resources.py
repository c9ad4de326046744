"""What this process holds right now: resident memory, file descriptors by kind, live tasks.

Read from /proc (Linux), so a leak shows as a number, not a guess. Sockets are told apart by
their ports (from /proc/net/tcp), so an upstream keep-alive pool is not mistaken for a leak.
"""

from __future__ import annotations

import asyncio
import gc
import os
import resource
from dataclasses import dataclass


def rss_bytes() -> int:
    """Resident set size of this process (VmRSS in /proc/self/status)."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def rss_mib() -> float:
    return rss_bytes() / (1 << 20)


def raise_fd_limit(wanted: int) -> int:
    """Raise the soft RLIMIT_NOFILE towards `wanted` (never above the hard limit); returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def _socket_ports() -> dict[int, tuple[int, int, str]]:
    """inode -> (local port, remote port, TCP state hex) for every IPv4/IPv6 TCP socket."""
    table: dict[int, tuple[int, int, str]] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name, encoding="ascii") as lines:
                next(lines)
                for line in lines:
                    parts = line.split()
                    local, remote, state, inode = parts[1], parts[2], parts[3], int(parts[9])
                    table[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16), state)
        except FileNotFoundError:
            continue
    return table


LISTEN = "0A"


@dataclass(frozen=True, slots=True)
class FdCensus:
    """This process's open descriptors: `touching[port]` counts connected TCP sockets with
    that port at either end (listening sockets are in `listening`)."""

    total: int
    non_socket: int
    listening: int
    touching: dict[int, int]
    other_sockets: int

    def without(self, *ports: int) -> int:
        """Descriptors not connected to any of `ports`: what must come back to its baseline."""
        return self.total - sum(self.touching.get(p, 0) for p in ports)


def fd_census(ports: tuple[int, ...] = ()) -> FdCensus:
    """Count /proc/self/fd, splitting TCP sockets by whether they touch one of `ports`."""
    table = _socket_ports()
    total = non_socket = listening = other = 0
    touching = dict.fromkeys(ports, 0)
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed while listing (the listing's own fd, for one)
            continue
        total += 1
        if not target.startswith("socket:["):
            non_socket += 1
            continue
        entry = table.get(int(target[8:-1]))
        if entry is None:
            other += 1
            continue
        local, remote, state = entry
        if state == LISTEN:
            listening += 1
            continue
        hit = next((p for p in ports if p in (local, remote)), None)
        if hit is None:
            other += 1
        else:
            touching[hit] += 1
    return FdCensus(total, non_socket, listening, touching, other)


def pending_tasks() -> set[asyncio.Task[object]]:
    """Tasks of the running loop not yet done, the caller's own excluded."""
    current = asyncio.current_task()
    return {t for t in asyncio.all_tasks() if not t.done() and t is not current}


def settle_memory() -> int:
    """Collect garbage and return the RSS after it."""
    gc.collect()
    return rss_bytes()
