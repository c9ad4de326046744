"""The experiment's second arm: the same levels again under a fixed admission limit, which proves or
refutes the remedy (`sweep --admission N[,M...]`), and the same comparison between two saved runs
(`sweep --compare A/sweep.json B/sweep.json`, before and after a server change).

The gate is the proxy's (`PUT /api/admission` on its admin listener, the admin token sent): set to N
for the arm, with no queue timeout ("no gateway timeouts"), and put back as it was afterwards, also
when the sweep is interrupted. With the gate, the sweep's own client timeout applies only where
`--timeout` was given.

An arm removes the cut when its answers are as whole at every level as the first arm's were at the
lowest (its completion rate not `COMPLETION_DROP` below, and its verdict shows no cut); its cost is
the waiting at the proxy (p95 of `queue_time_s` at the top level).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from proxy.sweep.sample import Sample
from proxy.sweep.stats import Interval, LevelSummary, by_level, quantile
from proxy.sweep.verdict import COMPLETION_DROP, Verdict

CUT_KINDS = frozenset({"policy", "serving_defect", "hidden_cap", "length_shift", "baseline_truncation"})
ADMIN_TIMEOUT_S = 10.0


class ArmError(Exception):
    """The proxy's gate could not be set (no admin, no token, an old proxy)."""


@dataclass(frozen=True, slots=True)
class Arm:
    """One arm of the experiment: the limit it ran under (None: the first arm, no gate), per level."""

    limit: int | None
    summaries: Sequence[LevelSummary]
    verdict: Verdict
    proxy_wait_p50: dict[int, float | None]
    proxy_wait_p95: dict[int, float | None]
    server_queue_p50: dict[int, float | None]
    label: str | None = None  # what the table calls it (--compare: before, after)

    @classmethod
    def of(cls, limit: int | None, summaries: Sequence[LevelSummary], verdict: Verdict,
           samples: Sequence[Sample]) -> Arm:
        groups = by_level(samples)
        proxy = {level: sorted(s.record.queue_time_s for s in group
                               if s.record.queue_time_source == "proxy" and s.record.queue_time_s is not None)
                 for level, group in groups.items()}
        server = {level: sorted(s.record.server_queue_s for s in group if s.record.server_queue_s is not None)
                  for level, group in groups.items()}
        return cls(limit, summaries, verdict,
                   {level: quantile(waits, 0.5) for level, waits in proxy.items()},
                   {level: quantile(waits, 0.95) for level, waits in proxy.items()},
                   {level: quantile(waits, 0.5) for level, waits in server.items()})

    @property
    def name(self) -> str:
        if self.label is not None:
            return self.label
        return "no gate" if self.limit is None else f"gate {self.limit}"

    def to_dict(self) -> dict[str, Any]:
        return {"limit": self.limit, "levels": [s.to_dict() for s in self.summaries], "verdict": self.verdict.to_dict(),
                "proxy_wait_p50_s": _keys(self.proxy_wait_p50), "proxy_wait_p95_s": _keys(self.proxy_wait_p95),
                "server_queue_p50_s": _keys(self.server_queue_p50)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Arm:
        """An arm as `to_dict` wrote it, or a whole sweep.json's first arm (its `levels` and `verdict`);
        ValueError for anything else."""
        def levels(key: str) -> dict[int, float | None]:
            return {int(k): v for k, v in (data.get(key) or {}).items()}

        try:
            summaries = [LevelSummary(**level) for level in data["levels"]]
            found = dict(data["verdict"])
            difference = found.get("length_difference")
            found["length_difference"] = Interval(**difference) if isinstance(difference, dict) else None
            found["evidence"] = tuple(found.get("evidence") or ())
            verdict = Verdict(**found)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a sweep's levels and verdict: {exc}") from None
        return cls(data.get("limit"), summaries, verdict, levels("proxy_wait_p50_s"), levels("proxy_wait_p95_s"),
                   levels("server_queue_p50_s"))


def _keys(values: dict[int, float | None]) -> dict[str, float | None]:
    return {str(level): value for level, value in values.items()}


# --- the gate, through the proxy's admin API --------------------------------------------------
class Gate:
    """The proxy's admission gate, set for an arm and put back as it was."""

    def __init__(self, session: aiohttp.ClientSession, admin: str, token: str | None) -> None:
        self._session = session
        self._url = admin.rstrip("/") + "/api/admission"
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.saved: dict[str, Any] | None = None

    async def _call(self, method: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            async with self._session.request(method, self._url, headers=self._headers,
                                             data=orjson.dumps(body) if body is not None else None,
                                             timeout=aiohttp.ClientTimeout(total=ADMIN_TIMEOUT_S)) as response:
                answer = await response.read()
                if response.status == 401:
                    raise ArmError("the proxy's admin API wants its token: give --admin-token (or "
                                   "LLM_DIAG_ADMIN_TOKEN)")
                if response.status != 200:
                    raise ArmError(f"{method} {self._url} answered {response.status}: the proxy cannot set its "
                                   "admission gate (one process, a version with --max-in-flight)")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ArmError(f"cannot reach the proxy's admin API at {self._url}: {exc}") from None
        found: dict[str, Any] = orjson.loads(answer)
        return found

    async def set(self, limit: int | None) -> None:
        if self.saved is None:
            self.saved = await self._call("GET")
        await self._call("PUT", {"max_in_flight": limit, "queue_timeout_s": None})

    async def restore(self) -> None:
        if self.saved is None:
            return
        saved, self.saved = self.saved, None
        with contextlib.suppress(ArmError):
            await self._call("PUT", {k: saved.get(k) for k in ("max_in_flight", "queue_max", "queue_timeout_s")})


# --- the comparison ----------------------------------------------------------------------------
def whole(arm: Arm, baseline: LevelSummary) -> bool:
    """Answers as whole at every level as the baseline's (the first arm at its lowest level)."""
    return arm.verdict.kind not in CUT_KINDS and all(
        s.completion_rate >= baseline.completion_rate - COMPLETION_DROP for s in arm.summaries)


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f}ms" if seconds < 1 else f"{seconds:.2f}s"


def side_by_side(arms: Sequence[Arm]) -> str:
    """Per level, each arm: completion, output tokens, stops, TTFT, waiting at the proxy and in the server."""
    header = ("conc", "arm", "n", "complete", "out tok med", "TTFT p50", "proxy wait p50/p95", "server queue p50",
              "stop reasons")
    rows = [header]
    levels = sorted({s.level for arm in arms for s in arm.summaries})
    for level in levels:
        for arm in arms:
            summary = next((s for s in arm.summaries if s.level == level), None)
            if summary is None:
                continue
            stops = " ".join(f"{k} {v}" for k, v in sorted(summary.stop_counts.items(), key=lambda kv: -kv[1]))
            rows.append((str(level), arm.name, str(summary.n), f"{summary.completion_rate:.0%}",
                         f"{summary.output_tokens_median:.0f}", _ms(summary.ttft_p50_s),
                         f"{_ms(arm.proxy_wait_p50.get(level))}/{_ms(arm.proxy_wait_p95.get(level))}",
                         _ms(arm.server_queue_p50.get(level)), stops))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) if i < 8 else cell for i, (cell, width) in enumerate(zip(row, widths,
                                                                                                  strict=True)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def verdict_lines(first: Arm, gated: Sequence[Arm]) -> list[str]:
    """Whether each cap removed the cut, at what cost in waiting, and the largest that keeps answers whole."""
    baseline = first.summaries[0] if first.summaries else None
    if baseline is None:
        return ["ADMISSION: no answers in the first arm to compare with"]
    cut = first.verdict.kind in CUT_KINDS
    lines = []
    kept = []
    for arm in gated:
        top = arm.summaries[-1] if arm.summaries else None
        cost = (f"the cost: waiting at the proxy p95 {_ms(arm.proxy_wait_p95.get(top.level))} at concurrency "
                f"{top.level}" if top is not None else "no answers")
        if whole(arm, baseline):
            kept.append(arm.limit)
            said = ("removes the cut" if cut else "keeps answers whole (the first arm showed no cut to remove)")
            lines.append(f"ADMISSION {arm.limit}: {said}: at every level answers are as complete as at concurrency "
                         f"{baseline.level} without the gate ({baseline.completion_rate:.0%}); {cost}")
        else:
            worst = min(arm.summaries, key=lambda s: s.completion_rate) if arm.summaries else None
            lines.append(f"ADMISSION {arm.limit}: does not remove the cut ({arm.verdict.kind}"
                         + (f": {worst.completion_rate:.0%} complete at concurrency {worst.level}" if worst else "")
                         + f"); {cost}")
    if cut and kept:
        best = max(limit for limit in kept if limit is not None)
        lines.append(f"=> the load was the cause, and admission is the remedy: at most {best} in flight keeps "
                     f"answers whole (the largest tried that does)")
    elif cut:
        lines.append("=> no limit tried removed the cut: it is not the load alone (or try a lower limit)")
    return lines


def compare_lines(before: Arm, after: Arm) -> list[str]:
    """Two runs, before and after a server change, in the same words."""
    baseline = before.summaries[0] if before.summaries else None
    if baseline is None or not after.summaries:
        return ["COMPARE: a run without answers"]
    was_cut = before.verdict.kind in CUT_KINDS
    now_whole = whole(after, baseline)
    if was_cut and now_whole:
        return [f"COMPARE: the change removed the cut: before, {before.verdict.headline}; after, answers at every "
                f"level as complete as before at concurrency {baseline.level} ({baseline.completion_rate:.0%})"]
    if was_cut:
        return [f"COMPARE: the change did not remove the cut: after, {after.verdict.headline}"]
    if not now_whole:
        return [f"COMPARE: the change brought a cut: after, {after.verdict.headline}"]
    return ["COMPARE: no cut before or after; only latency can have moved (see the table)"]
