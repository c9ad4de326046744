"""The simulator's /metrics: vLLM's own metric names, read from the engine at scrape time.

Names as vLLM exports them (vllm/v1/metrics/loggers.py): `vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (V1; a 0-1 fraction despite the name)
and `vllm:gpu_cache_usage_perc` (V0, the same value), `vllm:num_preemptions_total`, token and
finished-request counters, labelled `model_name` and `engine`. `llm_sim_finished_total` is the
simulator's own: the true cause of each end, which the wire hides (a deadline looks like EOS).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.simulator.engine import FINISH_CAUSES, EngineCore

ENGINE_LABEL = "0"


class VllmCollector(Collector):
    """Yields the metric families from the engine's current state."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    def collect(self) -> Iterator[Metric]:
        core, cfg = self.core, self.core.config
        labels = ["model_name", "engine"]
        values = [cfg.model, ENGINE_LABEL]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    core.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    core.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", core.kv_usage)
        yield gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.",
                    core.kv_usage)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      core.counters.preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", core.counters.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      core.counters.generation_tokens)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*labels, "finished_reason"])
        for reason in ("stop", "length"):
            success.add_metric([*values, reason], core.counters.finished_by_reason.get(reason, 0))
        yield success
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "num_gpu_blocks"])
        info.add_metric([str(cfg.block_size), str(cfg.kv_blocks or "None")], 1)
        yield info
        truth = CounterMetricFamily("llm_sim_finished", "Simulator only: sequences by the true cause of "
                                    "their end (the wire reports only stop or length).",
                                    labels=["model_name", "cause"])
        for cause in FINISH_CAUSES:
            truth.add_metric([cfg.model, cause], core.counters.finished_by_cause.get(cause, 0))
        yield truth
        yield CounterMetricFamily("llm_sim_rejected", "Simulator only: requests refused by the reject "
                                  "policy.", value=core.counters.rejected)
        yield CounterMetricFamily("llm_sim_aborted", "Simulator only: sequences dropped because their "
                                  "client went away or a fault cut them.", value=core.counters.aborted)


def metrics_registry(core: EngineCore) -> CollectorRegistry:
    """A registry of its own per simulator (several run side by side in tests)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(VllmCollector(core))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
