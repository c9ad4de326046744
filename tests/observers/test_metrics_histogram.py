"""The proxy's histogram exports what prometheus_client's own does, sample for sample, exemplars
included: every bound hit exactly, between bounds, below the first, past the last, +Inf, NaN."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry
from prometheus_client import Histogram as ClientHistogram

from proxy.observers.metrics import TTFT_BUCKETS, Histogram

VALUES = [*TTFT_BUCKETS[:-1], *(b * 1.0001 for b in TTFT_BUCKETS[:-1]), -1.0, 0.0, 1e-9, 61.0, 1e12,
          math.inf, math.nan, 0.3, 0.3]


def samples(histogram_class: type[ClientHistogram]) -> list[tuple[str, dict[str, str], float, object]]:
    registry = CollectorRegistry()
    histogram = histogram_class("h", "help", ["model"], buckets=TTFT_BUCKETS, registry=registry)
    child = histogram.labels("m")
    for index, value in enumerate(VALUES):
        child.observe(value, {"request_id": f"r{index}"} if index % 3 else None)
    out = []
    for metric in registry.collect():
        for sample in metric.samples:
            exemplar = None if sample.exemplar is None else (sample.exemplar.labels, sample.exemplar.value)
            out.append((sample.name, sample.labels, sample.value, exemplar))
    return out


def test_the_samples_and_exemplars_are_prometheus_clients_own() -> None:
    ours, theirs = samples(Histogram), samples(ClientHistogram)
    assert len(ours) == len(theirs) > len(TTFT_BUCKETS)
    for mine, reference in zip(ours, theirs, strict=True):
        name, labels, value, exemplar = mine
        assert (name, labels, exemplar) == (reference[0], reference[1], reference[3])
        if name.endswith("_created"):  # when each series started: two histograms made a moment apart
            assert abs(value - reference[2]) < 5
            continue
        assert value == reference[2] or (math.isnan(value) and math.isnan(reference[2]))


def test_every_series_says_when_it_started_whatever_prometheus_clients_switch_says() -> None:
    """`_created` lets the rules count a series from its birth (rate() sees no rise in its first scrape)."""
    from prometheus_client import disable_created_metrics, enable_created_metrics

    disable_created_metrics()  # type: ignore[no-untyped-call]
    try:
        names = [name for name, _, _, _ in samples(Histogram)]
    finally:
        enable_created_metrics()  # type: ignore[no-untyped-call]
    assert names.count("h_created") == 1
