"""A timeout somewhere in the path: cut answers whose durations repeat, which no one record can show.

A fixed timer in the path (a client SDK's timeout, nginx's `proxy_read_timeout`, a gateway's cap)
ends answers at one duration, again and again, while tokens may still be flowing; each record only
says `client_disconnect` or `upstream_disconnect`. Across records the duration shows: "cut at
60.0 s, 41 times, on the client's side".

The side comes from what the proxy saw, never from the duration:
- `client`: the client went away (`client_disconnect`): a timeout between the clients and the proxy;
- `upstream`: the connection to the server broke or failed (`upstream_disconnect`, an
  `upstream_error` of kind timeout, reset or abort): a timeout between the proxy and the server;
- `proxy`: the proxy's own `--deadline` or `--idle-timeout`, named as such.

Tolerance: max(TOLERANCE_S, TOLERANCE_SHARE of the duration). A timer fires at its set value
measured from when its own hop saw the request; the proxy measures from its own start, so the two
differ by the hops' latency and the scheduling of both clocks: milliseconds on a LAN, rarely a few
hundred. 1 % of 60 s is 0.6 s; a quarter second is the floor. Only cuts of at least MIN_DURATION_S
count (a client that cancels at once is no timer). A cluster must hold MIN_REPEATS cuts, and be
dense: half of that side's cuts, or five times what the same number spread evenly over their range
would put in a window that wide.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proxy.record import ResponseRecord

TOLERANCE_S = 0.25
TOLERANCE_SHARE = 0.01
MIN_DURATION_S = 1.0
MIN_REPEATS = 3
DENSITY = 5.0
_UPSTREAM_KINDS = frozenset({"timeout", "reset", "abort"})
# Timers that end answers at a known duration by default, and what they are.
SUSPECTS: tuple[tuple[float, str], ...] = (
    (60.0, "nginx's proxy_read_timeout (60 s by default; for a stream, a silence that long) or a load "
           "balancer's idle timeout (AWS ALB: 60 s by default)"),
    (100.0, "Cloudflare's proxy read timeout (100 s; it answers HTTP 524)"),
    (600.0, "the openai and anthropic Python SDKs' default timeout (600 s)"),
)


@dataclass(frozen=True, slots=True)
class RepeatedCut:
    """Cuts on one side of the proxy at one repeated duration."""

    side: str  # client, upstream or proxy
    duration_s: float  # the cluster's median
    count: int
    of: int  # that side's cuts of at least MIN_DURATION_S
    causes: tuple[tuple[str, int], ...]

    def text(self) -> str:
        causes = ", ".join(f"{cause} x{n}" for cause, n in self.causes)
        return (f"cut at {self.duration_s:.1f} s, {self.count} times ({causes}; {self.count} of {self.of} such "
                f"cuts): {where(self.side)}; {suspects(self.side, self.duration_s)}")

    def to_dict(self) -> dict[str, Any]:
        return {"side": self.side, "duration_s": round(self.duration_s, 3), "count": self.count, "of": self.of,
                "causes": dict(self.causes), "text": self.text()}


def side_of(record: ResponseRecord) -> str | None:
    """Which side of the proxy ended the answer, when it was cut by going away or breaking."""
    stop = record.stop_reason
    if stop == "client_disconnect":
        return "client"
    if stop == "upstream_disconnect" or (stop == "upstream_error" and record.upstream_error in _UPSTREAM_KINDS):
        return "upstream"
    if stop in ("deadline", "idle_timeout"):
        return "proxy"
    return None


def tolerance(duration_s: float) -> float:
    return max(TOLERANCE_S, TOLERANCE_SHARE * duration_s)


def repeated_cuts(records: Sequence[ResponseRecord]) -> list[RepeatedCut]:
    """The repeated durations among the cut records, one per side at most, most frequent first."""
    sides: dict[str, list[ResponseRecord]] = {}
    for record in records:
        side = side_of(record)
        if side is not None and record.duration_s >= MIN_DURATION_S:
            sides.setdefault(side, []).append(record)
    found = []
    for side, members in sides.items():
        members.sort(key=lambda r: r.duration_s)
        durations = [r.duration_s for r in members]
        best = (0, 0)  # the widest window: (start, end) indexes, end exclusive
        end = 0
        for start, low in enumerate(durations):
            end = max(end, start)
            while end < len(durations) and durations[end] - low <= tolerance(low):
                end += 1
            if end - start > best[1] - best[0]:
                best = (start, end)
        start, end = best
        count = end - start
        if count < MIN_REPEATS:
            continue
        spread = durations[-1] - durations[0]
        width = tolerance(durations[start])
        expected = len(durations) * width / spread if spread > 0 else float(len(durations))
        if not (count >= 0.5 * len(durations) or count >= DENSITY * expected):
            continue
        cluster = durations[start:end]
        causes = Counter(r.stop_reason if r.stop_reason != "upstream_error" else f"upstream_error:{r.upstream_error}"
                         for r in members[start:end])
        found.append(RepeatedCut(side, cluster[len(cluster) // 2], count, len(durations),
                                 tuple(causes.most_common())))
    return sorted(found, key=lambda c: -c.count)


def where(side: str) -> str:
    if side == "client":
        return ("the clients went away at that age: a timeout between the clients and the proxy (the client's "
                "own, or something in front of the proxy)")
    if side == "upstream":
        return ("the connection to the server ended at that age: a timeout between the proxy and the server (a "
                "gateway on the way, or the server's own limit)")
    return "the proxy's own limit ended them: its --deadline or --idle-timeout, set by you"


def suspects(side: str, duration_s: float) -> str:
    if side == "proxy":
        return "raise or remove it, or keep the load below where answers take that long"
    named = [words for value, words in SUSPECTS if abs(duration_s - value) <= tolerance(value)]
    if named:
        return "the usual suspect at this duration: " + "; ".join(named)
    return (f"look for a timer of about {duration_s:.0f} s: a client SDK's timeout, a load balancer's idle "
            "timeout, a gateway's cap (nginx's proxy_read_timeout is 60 s by default)")


def lines(records: Sequence[ResponseRecord]) -> list[str]:
    """The findings as printed lines (empty when no duration repeats)."""
    return [f"TIMEOUT IN THE PATH: {cut.text()}" for cut in repeated_cuts(records)]
