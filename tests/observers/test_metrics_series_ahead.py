"""Series the proxy can know ahead exist at 0 before anything could increment them: a model's cut
counts for every cause, from its listing by the server or from its first admitted request, and
never past the bound on model labels."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from proxy.observers.metrics import TRUNCATION_CAUSES, MetricsObserver, ProxyMetrics
from proxy.record import ResponseRecord


def cut_series(metrics: ProxyMetrics) -> dict[tuple[str, str], float]:
    return {(s.labels["model"], s.labels["cause"]): s.value for family in metrics.registry.collect()
            for s in family.samples if s.name == "llm_proxy_truncated_total"}


def test_a_model_the_server_lists_has_every_cut_cause_at_zero() -> None:
    metrics = ProxyMetrics(CollectorRegistry(), max_models=10)
    metrics.know_models(["listed"])
    assert cut_series(metrics) == {("listed", cause): 0.0 for cause in TRUNCATION_CAUSES}
    assert metrics.registry.get_sample_value("llm_proxy_prompt_truncated_total", {"model": "listed"}) == 0.0


def test_a_model_met_at_admission_has_its_series_before_its_answer_ends() -> None:
    metrics = ProxyMetrics(CollectorRegistry())
    record = ResponseRecord("r", "POST", "/v1/chat/completions", "/v1/chat/completions", "openai", 0.0, model="new")
    MetricsObserver(metrics).on_response_start(record)
    assert cut_series(metrics)[("new", "server_limit")] == 0.0


def test_listed_models_take_at_most_half_the_model_labels() -> None:
    metrics = ProxyMetrics(CollectorRegistry(), max_models=6)
    metrics.know_models([f"listed-{n}" for n in range(20)])
    metrics.know_models([f"later-{n}" for n in range(20)])
    assert {model for model, _ in cut_series(metrics)} == {"listed-0", "listed-1", "listed-2"}
    for n in range(3):  # the traffic's own models still get labels of their own
        assert metrics.model_label(f"used-{n}") == f"used-{n}"
    assert metrics.model_label("one-too-many") == "other"
