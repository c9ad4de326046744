"""What the telemetry observer writes into a finished record, from the samples of its window."""

from __future__ import annotations

from proxy.diagnosis.delivery import Delivery
from proxy.observers.telemetry.enricher import TelemetryEnricher
from proxy.observers.telemetry.gpu import GpuProcess, GpuReading, GpuSnapshot
from proxy.observers.telemetry.samples import SampleRing
from proxy.observers.telemetry.server_metrics import UpstreamState
from proxy.record import ResponseRecord

GIB = 1 << 30


def snap(*gpus: tuple[int, int, int, tuple[int, ...]]) -> GpuSnapshot:
    """GPUs as (index, used GiB, free GiB, pids)."""
    return GpuSnapshot(tuple(GpuReading(i, f"GPU-{i}", "A100", used * GIB, free * GIB, (used + free) * GIB, 0.5,
                                        tuple(GpuProcess(p, "vllm", GIB) for p in pids))
                             for i, used, free, pids in gpus), len(gpus))


def state(running: float | None = None, waiting: float | None = None, kv: float | None = None,
          preempted: float | None = None) -> UpstreamState:
    return UpstreamState("vllm", running, waiting, kv, preempted)


def record(start: float, duration: float) -> ResponseRecord:
    r = ResponseRecord(request_id="r1", method="POST", path="/v1/chat/completions", route="chat",
                       dialect="openai", started_at=start, status=200, stop_reason="eos")
    r.duration_s = duration
    return r


def gpu_ring(*samples: tuple[float, GpuSnapshot]) -> SampleRing[GpuSnapshot]:
    ring: SampleRing[GpuSnapshot] = SampleRing(100)
    for t, s in samples:
        ring.append(t, s)
    return ring


def upstream_ring(*samples: tuple[float, UpstreamState]) -> SampleRing[UpstreamState]:
    ring: SampleRing[UpstreamState] = SampleRing(100)
    for t, s in samples:
        ring.append(t, s)
    return ring


def observe(rec: ResponseRecord, gpus: SampleRing[GpuSnapshot] | None = None,
            upstream: SampleRing[UpstreamState] | None = None, pids: frozenset[int] = frozenset()) -> None:
    Delivery(enrichers=[TelemetryEnricher(gpus, 1.0, upstream, 1.0, upstream_pids=lambda: pids)]).response_finished(rec)


def test_vram_tags_are_the_extremes_of_the_samples_inside_the_response() -> None:
    ring = gpu_ring((99.0, snap((0, 70, 10, ()))), (100.5, snap((0, 40, 40, ()))),
                    (101.5, snap((0, 60, 20, ()))), (102.5, snap((0, 50, 30, ()))), (104.0, snap((0, 79, 1, ()))))
    rec = record(100.0, 3.0)
    observe(rec, gpus=ring)
    assert rec.gpu == "0"
    assert rec.vram_free_min_bytes == 20 * GIB  # not the 10 before the start nor the 1 after the end
    assert rec.vram_used_max_bytes == 60 * GIB


def test_response_shorter_than_the_interval_uses_the_sample_just_before_it() -> None:
    ring = gpu_ring((99.0, snap((0, 70, 10, ()))), (100.4, snap((0, 75, 5, ()))))
    rec = record(100.5, 0.2)
    observe(rec, gpus=ring)
    assert (rec.vram_free_min_bytes, rec.vram_used_max_bytes) == (5 * GIB, 75 * GIB)


def test_stale_samples_give_no_vram_tags() -> None:
    ring = gpu_ring((90.0, snap((0, 70, 10, ()))))  # the poller stopped 10 s before the response
    rec = record(100.0, 0.5)
    observe(rec, gpus=ring)
    assert (rec.gpu, rec.vram_free_min_bytes, rec.vram_used_max_bytes) == (None, None, None)


def test_vram_tags_follow_the_gpu_running_the_upstream_process() -> None:
    samples = [(100.0 + i, snap((0, 70, 10, ()), (1, 30 + i, 50 - i, (4242,)))) for i in range(3)]
    rec = record(100.0, 2.0)
    observe(rec, gpus=gpu_ring(*samples), pids=frozenset({4242}))
    assert rec.gpu == "1"
    assert (rec.vram_free_min_bytes, rec.vram_used_max_bytes) == (48 * GIB, 32 * GIB)


def test_without_a_known_upstream_process_the_busiest_gpu_is_chosen() -> None:
    rec = record(100.0, 1.0)
    observe(rec, gpus=gpu_ring((100.5, snap((0, 10, 70, ()), (1, 60, 20, ())))))
    assert rec.gpu == "1"


def test_gpu_missing_from_some_samples_counts_where_it_was_read() -> None:
    ring = gpu_ring((100.2, snap((0, 50, 30, ()))), (100.8, snap()), (101.4, snap((0, 55, 25, ()))))
    rec = record(100.0, 2.0)
    observe(rec, gpus=ring)
    assert (rec.gpu, rec.vram_free_min_bytes) == ("0", 25 * GIB)


def test_no_gpus_leaves_the_gpu_fields_empty() -> None:
    rec = record(100.0, 1.0)
    observe(rec, gpus=gpu_ring((100.5, snap())))
    assert rec.gpu is None and rec.vram_free_min_bytes is None


def test_upstream_tags_are_the_maxima_inside_the_response() -> None:
    ring = upstream_ring((99.0, state(50, 50, 1.0, 0)), (100.5, state(3, 0, 0.5, 1)),
                         (101.5, state(8, 4, 0.95, 1)), (102.5, state(2, 1, 0.4, 1)), (104.0, state(90, 90, 1.0, 9)))
    rec = record(100.0, 3.0)
    observe(rec, upstream=ring)
    assert (rec.upstream_running_max, rec.upstream_waiting_max, rec.kv_cache_usage_max) == (8, 4, 0.95)


def test_preemptions_during_is_the_server_wide_increase_from_before_start_to_before_end() -> None:
    ring = upstream_ring((99.5, state(preempted=10)), (100.5, state(preempted=12)),
                         (101.5, state(preempted=15)), (103.5, state(preempted=40)))
    rec = record(100.0, 2.0)
    observe(rec, upstream=ring)
    assert rec.preemptions_during == 5.0
    assert rec.preemptions_scope == "server_wide"


def test_preemptions_across_a_counter_reset_count_what_came_after_it() -> None:
    ring = upstream_ring((99.5, state(preempted=10)), (100.5, state(preempted=1)), (101.5, state(preempted=3)))
    rec = record(100.0, 2.0)
    observe(rec, upstream=ring)
    assert rec.preemptions_during == 3.0


def test_response_without_a_sample_inside_its_life_has_no_server_figures() -> None:
    ring = upstream_ring((99.5, state(running=4, kv=0.9, preempted=10)), (101.0, state(preempted=11)))
    rec = record(100.0, 0.5)
    observe(rec, upstream=ring)
    assert (rec.upstream_running_max, rec.kv_cache_usage_max) == (None, None)  # 99.5 is another moment
    assert rec.preemptions_during is None and rec.preemptions_scope is None


def test_a_request_the_server_refused_carries_no_server_figures() -> None:
    ring = upstream_ring((99.5, state(running=4, kv=0.9, preempted=10)), (100.2, state(running=5, kv=1.0,
                                                                                      preempted=12)))
    for status, stop in ((400, "upstream_error"), (429, "rejected"), (None, "upstream_error")):
        rec = record(100.0, 0.5)
        rec.status, rec.stop_reason = status, stop  # type: ignore[assignment]
        observe(rec, upstream=ring)
        assert (rec.upstream_running_max, rec.upstream_waiting_max, rec.kv_cache_usage_max,
                rec.preemptions_during) == (None, None, None, None), status


def test_no_preemption_count_without_a_fresh_sample_before_the_start() -> None:
    ring = upstream_ring((90.0, state(preempted=10)), (100.5, state(preempted=12)))
    rec = record(100.0, 1.0)
    observe(rec, upstream=ring)
    assert rec.preemptions_during is None


def test_server_without_a_preemption_counter_gives_no_count() -> None:
    ring = upstream_ring((99.5, state(running=1)), (100.5, state(running=2)))
    rec = record(100.0, 1.0)
    observe(rec, upstream=ring)
    assert rec.upstream_running_max == 2 and rec.preemptions_during is None


def test_disabled_telemetry_leaves_every_field_empty() -> None:
    rec = record(100.0, 1.0)
    observe(rec)
    assert (rec.gpu, rec.vram_free_min_bytes, rec.upstream_running_max, rec.kv_cache_usage_max,
            rec.preemptions_during) == (None, None, None, None, None)


# --- a model that left while the answer ran -------------------------------------------------------------
def listed(*names: str) -> UpstreamState:
    return UpstreamState("ollama", lists_models=True, loaded=names)


def unloaded_of(model: str, *samples: tuple[float, UpstreamState]) -> bool | None:
    rec = record(100.0, 3.0)
    rec.model, rec.stop_reason = model, "upstream_disconnect"
    observe(rec, upstream=upstream_ring(*samples))
    return rec.model_unloaded


def test_a_model_listed_at_the_start_and_gone_during_the_answer_was_unloaded() -> None:
    assert unloaded_of("qwen3:4b", (99.8, listed("qwen3:4b")), (101.0, listed("llama3.2:latest"))) is True
    assert unloaded_of("llama3.2", (100.5, listed("llama3.2:latest")), (102.0, listed())) is True  # (its tag)


def test_nothing_is_said_without_proof() -> None:
    assert unloaded_of("m", (101.0, listed())) is None  # never listed in its time: it may be loading
    assert unloaded_of("m", (90.0, listed("m")), (101.0, listed())) is None  # listed long before it began
    assert unloaded_of("m", (99.8, listed("m")), (101.0, listed("m"))) is None  # still there
    assert unloaded_of("m", (99.8, state(1, 0, 0.5, 0)), (101.0, state(1, 0, 0.5, 0))) is None  # lists nothing


def test_an_answer_whose_model_left_has_the_cause_model_unloaded() -> None:
    rec = record(100.0, 3.0)
    rec.model, rec.stop_reason, rec.model_unloaded = "m", "upstream_disconnect", True
    assert (rec.cause, rec.outcome) == ("model_unloaded", "cut")
    rec.stop_reason = "eos"  # a whole answer is whole, whatever happened after
    assert rec.cause == "eos"
