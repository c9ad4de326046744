"""Cutting a byte string into chunks at given points: how the tests play arbitrary network chunking."""

from __future__ import annotations

from collections.abc import Iterable


def split_at(data: bytes, cuts: Iterable[int]) -> list[bytes]:
    """`data` cut at each point (taken modulo its length + 1), empty pieces dropped."""
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for point in points:
        pieces.append(data[last:point])
        last = point
    pieces.append(data[last:])
    return [p for p in pieces if p]
