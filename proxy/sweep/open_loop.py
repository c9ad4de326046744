"""Open-loop sweeps: requests arrive at a fixed rate, as real traffic does, whatever the server's pace.

`sweep --rates 1,2,4,8` sends, at each rate, the same request at `rate` per second for
`--rate-seconds` (constant spacing, or Poisson arrivals drawn from the sweep's seed), without
waiting for answers: the concurrency a request meets is then the server's doing, and each
request's record says what it met (`concurrency_peak`, the proxy's when joined through `--admin`).
Per rate: completion, latency, the concurrency met, and goodput: the answers that ended on their own
within the targets (`--slo ttft=500ms,itl=50ms,e2e=30s`; per request TTFT, mean inter-token
latency, end-to-end), per second and as a share, as GuideLLM, AIPerf and `vllm bench serve` score
it. The verdict takes the concurrency each request met as its levels (the sweep's own rules), and
names the rate from which the answers are cut as well.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proxy.config import ConfigError, parse_duration
from proxy.sweep.sample import Sample
from proxy.sweep.stats import is_complete, quantile

MAX_RATE = 10_000.0
MAX_ARRIVALS = 100_000  # per rate: a typo in --rates or --rate-seconds is not a denial of service


def parse_rates(value: str) -> tuple[float, ...]:
    """`0.5,1,2,4` -> requests per second: positive, distinct, ascending."""
    rates: set[float] = set()
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        try:
            rate = float(part)
        except ValueError:
            raise ConfigError(f"invalid rate {part!r} in {value!r}: requests per second, like 1,2,4") from None
        if not 0 < rate <= MAX_RATE:
            raise ConfigError(f"invalid rate {part!r}: must be above 0 and at most {MAX_RATE:g} per second")
        rates.add(rate)
    if not rates:
        raise ConfigError(f"invalid rates {value!r}: expected a list like 1,2,4,8")
    return tuple(sorted(rates))


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency targets an answer must meet to count as goodput (None: no target on that one)."""

    ttft_s: float | None = None
    itl_s: float | None = None
    e2e_s: float | None = None

    def met(self, sample: Sample) -> bool:
        """Ended on its own, and within every target."""
        record = sample.record
        if not is_complete(record):
            return False
        checks = ((self.ttft_s, record.ttft_s), (self.itl_s, record.itl_mean_s), (self.e2e_s, record.duration_s))
        return all(target is None or (value is not None and value <= target) for target, value in checks)

    def describe(self) -> str:
        parts = [f"{name}<={_ms(target)}" for name, target in (("ttft", self.ttft_s), ("itl", self.itl_s),
                                                                 ("e2e", self.e2e_s)) if target is not None]
        return ", ".join(parts) or "complete only"


def parse_slo(value: str) -> Slo:
    """`ttft=500ms,itl=50ms,e2e=30s` -> Slo (ms, s, m accepted)."""
    found: dict[str, float] = {}
    for part in (p.strip() for p in value.split(",") if p.strip()):
        name, sep, amount = part.partition("=")
        name = name.strip().lower()
        if not sep or name not in ("ttft", "itl", "e2e"):
            raise ConfigError(f"invalid --slo {value!r}: expected ttft=500ms,itl=50ms,e2e=30s")
        text = amount.strip().lower()
        try:
            seconds = float(text[:-2]) / 1000 if text.endswith("ms") else parse_duration(text)
        except (ValueError, ConfigError):
            raise ConfigError(f"invalid --slo {name} {amount!r}: a duration like 500ms or 30s") from None
        if not seconds > 0:
            raise ConfigError(f"invalid --slo {name} {amount!r}: must be above 0")
        found[name] = seconds
    if not found:
        raise ConfigError(f"invalid --slo {value!r}: expected ttft=500ms,itl=50ms,e2e=30s")
    return Slo(found.get("ttft"), found.get("itl"), found.get("e2e"))


def arrivals(rate: float, seconds: float, kind: str, seed: int) -> list[float]:
    """When each request is sent, in seconds from the start of its rate: `constant` spacing 1/rate,
    or `poisson` (exponential gaps, drawn from `seed` and the rate, so a run can be repeated)."""
    if kind == "constant":
        count = min(MAX_ARRIVALS, max(1, int(rate * seconds + 1e-9)))
        return [n / rate for n in range(count)]
    rng = random.Random(f"{seed}:{rate}")
    times: list[float] = []
    at = 0.0
    while at < seconds and len(times) < MAX_ARRIVALS:
        times.append(at)
        at += rng.expovariate(rate)
    return times


@dataclass(frozen=True, slots=True)
class RateSummary:
    """One rate of an open-loop sweep."""

    rate: float
    sent: int
    seconds: float  # from the first send to the last answer
    complete: int
    good: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    e2e_p50_s: float | None
    e2e_p95_s: float | None
    concurrency_median: float | None
    concurrency_max: int

    @property
    def completion_rate(self) -> float:
        return self.complete / self.sent if self.sent else 0.0

    @property
    def goodput_per_s(self) -> float:
        return self.good / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"rate": self.rate, "sent": self.sent, "seconds": round(self.seconds, 3), "complete": self.complete,
                "completion_rate": round(self.completion_rate, 4), "good": self.good,
                "goodput_per_s": round(self.goodput_per_s, 4), "ttft_p50_s": self.ttft_p50_s,
                "ttft_p95_s": self.ttft_p95_s, "e2e_p50_s": self.e2e_p50_s, "e2e_p95_s": self.e2e_p95_s,
                "concurrency_median": self.concurrency_median, "concurrency_max": self.concurrency_max}


def summarize_rates(samples: Sequence[Sample], slo: Slo, window_s: float) -> list[RateSummary]:
    """Per rate; goodput per second over the rate's window (`window_s`, or until its last answer)."""
    by_rate: dict[float, list[Sample]] = {}
    for sample in samples:
        if sample.client.rate is not None:
            by_rate.setdefault(sample.client.rate, []).append(sample)
    found = []
    for rate, group in sorted(by_rate.items()):
        ttft = sorted(s.record.ttft_s for s in group if s.record.ttft_s is not None)
        e2e = sorted(s.record.duration_s for s in group)
        met = sorted(float(s.record.concurrency_peak) for s in group)
        span = max(window_s, max(s.client.sent_s + s.client.duration_s for s in group))
        found.append(RateSummary(rate, len(group), span, sum(1 for s in group if is_complete(s.record)),
                                 sum(1 for s in group if slo.met(s)), quantile(ttft, 0.5), quantile(ttft, 0.95),
                                 quantile(e2e, 0.5), quantile(e2e, 0.95), quantile(met, 0.5),
                                 int(max(met)) if met else 0))
    return found


def rate_onset(rates: Sequence[RateSummary], drop: float, min_cut: int) -> RateSummary | None:
    """The first rate whose completion falls `drop` below the lowest rate's, with `min_cut` cut."""
    if len(rates) < 2:
        return None
    base = rates[0]
    return next((r for r in rates[1:] if base.completion_rate - r.completion_rate >= drop
                 and r.sent - r.complete >= min_cut), None)


def render(rates: Sequence[RateSummary], slo: Slo) -> str:
    """The per-rate table, as printed."""
    head = (f"{'rate/s':>7} {'sent':>5} {'complete':>9} {'goodput/s':>10} {'good':>6} {'TTFT p50/p95':>15} "
            f"{'e2e p50/p95':>15} {'conc met med/max':>17}")
    lines = [f"open loop, goodput: answers complete within {slo.describe()}", head]
    for r in rates:
        lines.append(f"{r.rate:>7g} {r.sent:>5} {r.completion_rate:>8.0%} {r.goodput_per_s:>10.2f} "
                     f"{r.good / r.sent if r.sent else 0:>6.0%} {_ms(r.ttft_p50_s) + '/' + _ms(r.ttft_p95_s):>15} "
                     f"{_ms(r.e2e_p50_s) + '/' + _ms(r.e2e_p95_s):>15} "
                     f"{f'{r.concurrency_median or 0:g}/{r.concurrency_max}':>17}")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.2f}s"
