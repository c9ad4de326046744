"""The record metrics of several processes as one: what `--workers N` serves on its one `/metrics`.

Each worker counts its own records in its own registry (no per-record work leaves the worker); the
supervisor asks each for a `snapshot` of it when it is scraped and serves them summed
(`MergedMetrics`): counters, histograms and summaries add up sample by sample, a series' `_created`
is the earliest of them, a histogram bucket keeps the newest exemplar, and a gauge (the history's up)
is the lowest, the worst of them.

A merged counter never goes back: when a worker dies (or is restarted), its last snapshot is
retired, kept and added to the sum, so the count of the proxy as a whole goes on from where it was
(Prometheus would read a drop as a reset and count the whole sum again). What the dead worker
counted after its last snapshot is lost with it; the supervisor adds the records it was still
making (`add`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Exemplar

SUMMED = frozenset({"counter", "histogram", "summary"})
Key = tuple[str, tuple[tuple[str, str], ...]]  # a sample's name and its labels, sorted


def snapshot(registry: CollectorRegistry) -> list[dict[str, Any]]:
    """A registry's families as plain data (JSON): name, type, help, and each sample with its
    labels, value and exemplar."""
    families = []
    for family in registry.collect():
        samples = []
        for sample in family.samples:
            exemplar = sample.exemplar
            samples.append([sample.name, sample.labels, sample.value,
                            None if exemplar is None else [exemplar.labels, exemplar.value, exemplar.timestamp]])
        families.append({"name": family.name, "type": family.type, "help": family.documentation,
                         "samples": samples})
    return families


def _key(name: str, labels: dict[str, str]) -> Key:
    return name, tuple(sorted(labels.items()))


class MergedMetrics(Collector):
    """The latest snapshot of each process, and what retired processes counted, served as one."""

    def __init__(self) -> None:
        self._live: dict[int, list[dict[str, Any]]] = {}
        self._retired: dict[Key, float] = {}  # summed samples of processes that are gone
        self._retired_created: dict[Key, float] = {}
        self._meta: dict[str, tuple[str, str]] = {}  # family name -> (type, help)
        self._family_of: dict[str, str] = {}  # sample name -> family name

    def update(self, owner: int, families: list[dict[str, Any]]) -> None:
        """Process `owner`'s snapshot, the newest."""
        self._live[owner] = families
        for family in families:
            self._meta[family["name"]] = (family["type"], family["help"])
            for sample in family["samples"]:
                self._family_of[sample[0]] = family["name"]

    def retire(self, owner: int) -> None:
        """Process `owner` is gone: what its last snapshot counted stays in the sum for good."""
        families = self._live.pop(owner, None)
        for family in families or ():
            if family["type"] not in SUMMED:
                continue
            for name, labels, value, _ in family["samples"]:
                key = _key(name, labels)
                if name.endswith("_created"):
                    self._retired_created[key] = min(value, self._retired_created.get(key, value))
                else:
                    self._retired[key] = self._retired.get(key, 0.0) + value

    def add(self, family: str, kind: str, help_text: str, sample: str, value: float,
            labels: dict[str, str] | None = None) -> None:
        """Something the supervisor counted for a process that is gone (the records it took with it)."""
        self._meta.setdefault(family, (kind, help_text))
        self._family_of[sample] = family
        key = _key(sample, labels or {})
        self._retired[key] = self._retired.get(key, 0.0) + value

    def collect(self) -> Iterator[Metric]:
        """The sum, in the order the processes' own registries wrote their samples: the samples of
        one series stay together (buckets, count, sum, created), as OpenMetrics asks."""
        order: dict[Key, None] = {}
        values: dict[Key, float] = {}
        exemplars: dict[Key, Exemplar] = {}
        newest_at: dict[Key, float] = {}
        for snapshot_of_one in self._live.values():
            for family in snapshot_of_one:
                summed = family["type"] in SUMMED
                for name, labels, value, exemplar in family["samples"]:
                    key = _key(name, labels)
                    order[key] = None
                    if key not in values:
                        values[key] = value
                    elif not summed or name.endswith("_created"):
                        values[key] = min(values[key], value)  # a gauge's worst, a series' earliest start
                    else:
                        values[key] += value
                    if exemplar is not None and float(exemplar[2] or 0.0) >= newest_at.get(key, -1.0):
                        newest_at[key] = float(exemplar[2] or 0.0)  # the newest exemplar of the bucket
                        exemplars[key] = Exemplar(exemplar[0], exemplar[1], exemplar[2])
        for key, value in self._retired.items():
            order[key] = None
            values[key] = values.get(key, 0.0) + value
        for key, value in self._retired_created.items():
            order[key] = None
            values[key] = min(value, values.get(key, value))
        merged: dict[str, Metric] = {}
        for key in order:
            name, labels = key
            family_name = self._family_of.get(name)
            if family_name is None:
                continue
            metric = merged.get(family_name)
            if metric is None:
                kind, help_text = self._meta[family_name]
                metric = merged[family_name] = Metric(family_name, help_text, kind)
            metric.add_sample(name, dict(labels), values[key], exemplar=exemplars.get(key))
        yield from merged.values()
