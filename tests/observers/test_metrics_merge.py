"""Several processes' record metrics served as one: summed sample by sample, each series from its
earliest start, the newest exemplar, a gauge's worst; and a count that never goes back when a worker
dies and is started again."""

from __future__ import annotations

import orjson
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from proxy.observers.metrics import MetricsObserver, RecordMetrics
from proxy.observers.metrics_merge import MergedMetrics, snapshot
from proxy.record import ResponseRecord


def answered(request_id: str, stop: str = "eos", peak: int = 1, output: int = 10) -> ResponseRecord:
    return ResponseRecord(request_id=request_id, method="POST", path="/v1/chat/completions",
                          route="/v1/chat/completions", dialect="openai", started_at=0.0, model="m", status=200,
                          stop_reason=stop, length_cause="server_limit" if stop == "length" else None,
                          concurrency_peak=peak, output_tokens=output, tokens_source="usage", duration_s=0.5,
                          ttft_s=0.01)


def worker(*records: ResponseRecord) -> RecordMetrics:
    metrics = RecordMetrics(CollectorRegistry())
    observer = MetricsObserver(metrics)
    for record in records:
        observer.on_response(record)
    return metrics


def served(merged: MergedMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(merged)
    text = openmetrics(registry).decode()  # (parses: the samples of each series stay together)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(v for (n, found), v in samples.items() if n == name and set(labels.items()) <= set(found))


def test_two_workers_are_summed_sample_by_sample_through_json() -> None:
    one = worker(answered("a"), answered("b", "length", peak=4, output=3))
    two = worker(answered("c"), answered("d"), answered("e", "length", peak=4, output=5))
    merged = MergedMetrics()
    for owner, metrics in ((1, one), (2, two)):
        merged.update(owner, orjson.loads(orjson.dumps(snapshot(metrics.registry))))  # as it crosses the pipe
    samples = served(merged)
    assert value(samples, "llm_proxy_requests_total") == 5
    assert value(samples, "llm_proxy_requests_total", outcome="cut") == 2
    assert value(samples, "llm_proxy_truncated_total", cause="server_limit") == 2
    assert value(samples, "llm_proxy_output_tokens_count") == 5 and value(samples, "llm_proxy_output_tokens_sum") == 38
    assert value(samples, "llm_proxy_output_tokens_bucket", le="+Inf", concurrency="4") == 2
    created = [v for (n, _), v in samples.items() if n == "llm_proxy_requests_created"]
    assert created and all(v > 1.7e9 for v in created)


def test_a_dead_workers_count_stays_in_the_sum_and_its_restart_adds_to_it() -> None:
    merged = MergedMetrics()
    merged.update(1, snapshot(worker(answered("a"), answered("b")).registry))
    merged.update(2, snapshot(worker(answered("c")).registry))
    assert value(served(merged), "llm_proxy_requests_total") == 3
    merged.retire(1)  # worker 1 died: what it counted stays
    merged.add("llm_proxy_records_lost", "counter", "lost", "llm_proxy_records_lost_total", 2.0)
    assert value(served(merged), "llm_proxy_requests_total") == 3
    merged.update(1, snapshot(worker(answered("d")).registry))  # started again, from 0
    samples = served(merged)
    assert value(samples, "llm_proxy_requests_total") == 4
    assert value(samples, "llm_proxy_records_lost_total") == 2


def test_the_history_is_up_only_while_every_worker_writes() -> None:
    up, down = RecordMetrics(CollectorRegistry()), RecordMetrics(CollectorRegistry())
    up.history_up.set(1)
    down.history_up.set(0)
    merged = MergedMetrics()
    merged.update(1, snapshot(up.registry))
    merged.update(2, snapshot(down.registry))
    assert value(served(merged), "llm_proxy_history_up") == 0
