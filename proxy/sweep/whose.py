"""Whose answers are cut, and whose traffic held the server when they were.

From the records' `client` (a keyed hash of the API key, or the header the operator names): per
client, how many of its answers the serving layer cut; and, over the cut answers, which clients'
requests were in flight beside them (a request counts for the cut answers it overlapped in time).
Read for what it is: holding most of the concurrency at the cuts says whose traffic made the load,
not that this client caused the cut.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from typing import Any

from proxy.record import ResponseRecord

TOP = 5
NO_KEY = "(no API key)"  # requests that carried no key (and no --client-header value) to name a client by
MAX_PAIRS = 2_000_000  # overlaps looked at, at most: the cut answers are taken newest first


def whose(records: Sequence[ResponseRecord]) -> dict[str, Any] | None:
    """Cut answers by client and the clients in flight at the cuts; None when no record names a client."""
    named = [r for r in records if r.outcome != "not_inference"]
    if not any(r.client for r in named):
        return None
    sent: Counter[str] = Counter(r.client or NO_KEY for r in named)
    cut: Counter[str] = Counter(r.client or NO_KEY for r in named if r.outcome == "cut")
    by_start = sorted(named, key=lambda r: r.started_at)
    starts = [r.started_at for r in by_start]
    longest = max((r.duration_s for r in by_start), default=0.0)
    held: Counter[str] = Counter()
    looked = 0
    cuts = sorted((r for r in named if r.outcome == "cut"), key=lambda r: -r.started_at)
    for victim in cuts:
        end = victim.started_at + victim.duration_s
        low = bisect.bisect_left(starts, victim.started_at - longest)
        high = bisect.bisect_right(starts, end)
        looked += high - low
        for other in by_start[low:high]:
            if other is not victim and other.started_at + other.duration_s > victim.started_at:
                held[other.client or NO_KEY] += 1
        if looked > MAX_PAIRS:
            break
    total_held = sum(held.values())
    return {
        "cut": [{"client": name, "cut": n, "sent": sent[name]} for name, n in cut.most_common(TOP)],
        "in_flight_at_cuts": [{"client": name, "share": round(n / total_held, 3)}
                              for name, n in held.most_common(TOP)] if total_held else [],
        "cut_total": sum(cut.values()),
    }


def lines(records: Sequence[ResponseRecord]) -> list[str]:
    """The finding as printed (empty when no record names a client)."""
    found = whose(records)
    if found is None:
        return []
    if not found["cut"]:
        return ["WHOSE ANSWERS ARE CUT: none: no client's answers were cut"]
    cut = ", ".join(f"{c['client']} {c['cut']} of {c['sent']} ({c['cut'] / c['sent']:.0%})" for c in found["cut"])
    out = [f"WHOSE ANSWERS ARE CUT: {cut}"]
    if found["in_flight_at_cuts"]:
        held = ", ".join(f"{c['client']} {c['share']:.0%}" for c in found["in_flight_at_cuts"])
        out.append(f"IN FLIGHT WHEN THEY WERE CUT (the requests beside the {found['cut_total']} cut answers, by "
                   f"client): {held}")
    return out
