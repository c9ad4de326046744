"""Loopback ports for the servers the tests start as processes of their own."""

from __future__ import annotations

import socket


def free_port() -> int:
    """An ephemeral loopback port that was free a moment ago (for servers that cannot report port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
