"""What the GPU and the upstream looked like while a response ran, from the pollers' rings.

An enricher: the diagnosis writes its facts into the record before the exporters run, so they
reach the metrics, the log and the record store. It only reads the rings (bisect, then the
samples of the window): no I/O.

The server's own figures (running, waiting, KV usage, preemptions) describe a request only from
samples taken inside its life, and only when the server took the request on: a request it
refused (an HTTP error status, no answer at all) never ran, so it carries none. GPU memory is a
reading of the machine, and a response shorter than the poll interval may use the sample just
before it (see proxy.observers.telemetry.samples).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from proxy.observers.telemetry.gpu import GpuReading, GpuSnapshot, attributed_gpu
from proxy.observers.telemetry.samples import SampleRing, counter_increase, max_of, min_of
from proxy.observers.telemetry.server_metrics import UpstreamState
from proxy.record import ResponseRecord, ServerDuring

PREEMPTIONS_SCOPE = "server_wide"


def _ran_upstream(record: ResponseRecord) -> bool:
    """The upstream took the request on: it answered, without an error status, a generation."""
    return record.status is not None and record.status < 400 and record.stop_reason != "not_inference"


def max_age_for(interval_s: float) -> float:
    """How old the sample before a response may be and still stand for it: two intervals."""
    return 2.0 * interval_s + 0.25


class TelemetryEnricher:
    """The facts `gpu`, `vram_*`, `upstream_*_max`, `kv_cache_usage_max` and `preemptions_*` of a
    response. A fact stays None when no sample counts for the response (see .samples)."""

    def __init__(self, gpu_ring: SampleRing[GpuSnapshot] | None, gpu_interval_s: float,
                 upstream_ring: SampleRing[UpstreamState] | None, upstream_interval_s: float,
                 upstream_pids: Callable[[], Collection[int]] = frozenset) -> None:
        self.gpu_ring = gpu_ring
        self.gpu_max_age = max_age_for(gpu_interval_s)
        self.upstream_ring = upstream_ring
        self.upstream_max_age = max_age_for(upstream_interval_s)
        self.upstream_pids = upstream_pids

    def during(self, record: ResponseRecord) -> ServerDuring | None:
        t0 = record.started_at
        t1 = t0 + max(record.duration_s, 0.0)
        facts: ServerDuring = self._gpu(t0, t1) if self.gpu_ring is not None else {}
        if self.upstream_ring is not None and _ran_upstream(record):
            facts.update(self._upstream(t0, t1))
            if record.model is not None and self._unloaded(record.model, t0, t1):
                facts["model_unloaded"] = True
            facts.update(self._kv_held(record))
        return facts or None

    def _kv_held(self, record: ResponseRecord) -> ServerDuring:
        """The KV-cache blocks the request held at its end, `ceil((prompt + output) / block_size)`, and
        their share of the pool, by the server's own counts (usage or its span: never a count of the
        proxy's, which is a lower bound) and the pool its metrics state (vLLM's cache_config_info)."""
        server_counts = ("usage", "server_trace")
        if (record.prompt_tokens is None or record.output_tokens is None or record.tokens_source not in server_counts
                or record.prompt_tokens_source not in server_counts or (record.n or 1) > 1):
            return {}
        assert self.upstream_ring is not None
        latest = self.upstream_ring.latest()
        state = latest[1] if latest is not None else None
        if state is None or state.kv_block_size is None:
            return {}
        held = -(-(record.prompt_tokens + record.output_tokens) // state.kv_block_size)
        share = round(held / state.kv_blocks, 4) if state.kv_blocks else None
        return {"kv_blocks_held": held, "kv_pool_share": share}

    def _unloaded(self, model: str, t0: float, t1: float) -> bool:
        """The server's own list of what it runs (Ollama's `/api/ps`, a llama.cpp router's `/v1/models`)
        showed the answer's model, then, in a sample taken while the answer ran, no longer did: it was
        unloaded, swapped or evicted under it. A server that lists nothing, or a model it never listed
        in the answer's time (one still loading), proves nothing."""
        ring = self.upstream_ring
        assert ring is not None
        first = ring.index_at_or_before(t0)
        last = ring.index_at_or_before(t1)
        if last is None:
            return False
        if first is None:
            first = 0
        elif t0 - ring.stamp(first) > self.upstream_max_age:  # (too old to say it ran at the start)
            first += 1
        names = (model, f"{model}:latest") if ":" not in model else (model,)
        listed = False
        for stamp, state in ring.span(first, last):
            if state.loaded is None:
                continue
            if any(name in state.loaded for name in names):
                listed = True
            elif listed and stamp >= t0:
                return True
        return False

    def _gpu(self, t0: float, t1: float) -> ServerDuring:
        assert self.gpu_ring is not None
        window = self.gpu_ring.window(t0, t1, self.gpu_max_age)
        if not window:
            return {}
        chosen = attributed_gpu(window[-1][1].gpus, self.upstream_pids())
        if chosen is None:
            return {}
        readings: list[GpuReading] = [g for _, snap in window for g in snap.gpus if g.uuid == chosen.uuid]
        free = min_of(g.free_bytes for g in readings)
        used = max_of(g.used_bytes for g in readings)
        return {"gpu": str(chosen.index), "vram_free_min_bytes": None if free is None else int(free),
                "vram_used_max_bytes": None if used is None else int(used)}

    def _upstream(self, t0: float, t1: float) -> ServerDuring:
        ring = self.upstream_ring
        assert ring is not None
        found: ServerDuring = {}
        window = [state for _, state in ring.window(t0, t1, max_age=0.0)]  # inside its life only
        if window:
            found["upstream_running_max"] = max_of(s.running for s in window)
            found["upstream_waiting_max"] = max_of(s.waiting for s in window)
            found["kv_cache_usage_max"] = max_of(s.kv_cache_usage for s in window)
        # Preemptions: from the last sample at/before the start to the last one at/before
        # the end; only when the end sample was taken after the start, so something was seen.
        first = ring.index_at_or_before(t0)
        last = ring.index_at_or_before(t1)
        if first is None or last is None or last <= first:
            return found
        if t0 - ring.stamp(first) > self.upstream_max_age:
            return found
        increase = counter_increase(s.preemptions_total for _, s in ring.span(first, last))
        if increase is not None:
            found["preemptions_during"] = increase
            found["preemptions_scope"] = PREEMPTIONS_SCOPE
        return found
