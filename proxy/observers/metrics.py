"""Every Prometheus metric the proxy exports, declared in one place.

Names are fixed: dashboards and alerts depend on them. Label values come from bounded sets;
model names are capped (`max_models`, the rest reported as `other`).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client import Counter as _Counter
from prometheus_client import Histogram as _Histogram
from prometheus_client import Summary as _Summary
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar, Sample

from proxy.observers.hooks import Observer
from proxy.record import CUT_CAUSES, UPSTREAM_ERROR_KINDS, ResponseRecord, concurrency_bucket

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, float("inf"))
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, float("inf"))
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5, float("inf"))
# What became of a span of the server's (`proxy.diagnosis.server_traces`), and the queue times the
# server itself measured (not the proxy's own wait).
SPAN_RESULTS = ("joined", "late", "unmatched", "dropped", "not_request")
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 600, float("inf"))
# The cause label of llm_proxy_truncated_total: what the serving layer cut (outcome "cut").
TRUNCATION_CAUSES = CUT_CAUSES
INCOMPLETE_PARTS = ("tool_call", "json")  # the part label of llm_proxy_incomplete_answers_total
OTHER_MODEL = "other"
NO_MODEL = "none"



class Created:
    """Every series with its `_created` sample, the moment it started from 0, whatever
    prometheus_client's global switch says. `rate()` and `increase()` see nothing of a series'
    first scrape: a label set first scraped at 3 (a new model's first cut answers, a concurrency
    bucket a burst just reached, every series after a restart) would lose those 3, and an alert on
    the first cut would never fire. With the created time the rules count a series born inside
    their window from 0 (deploy/prometheus/rules); a Prometheus that ingests it as a zero sample
    (`--enable-feature=created-timestamp-zero-ingestion`) does so by itself."""

    _created: float

    def _child_samples(self) -> Iterable[Sample]:
        samples = tuple(super()._child_samples())  # type: ignore[misc]
        if samples and samples[-1].name == "_created":
            return samples
        return (*samples, Sample("_created", {}, self._created, None, None))


class Counter(Created, _Counter):
    """prometheus_client's counter, its `_created` sample always exported."""


class Summary(Created, _Summary):
    """prometheus_client's summary, its `_created` sample always exported."""


class Histogram(Created, _Histogram):
    """prometheus_client's histogram with its bucket found by bisection (its own `observe` walks the
    bounds in Python) and each exemplar taken as given: the proxy's are one fixed label name,
    `request_id`, and at most 64 characters (OpenMetrics allows 128 in all), so prometheus_client's
    check of every exemplar's names is not needed. The samples exported are the same. With
    `--workers N` one supervisor observes every worker's records: this is its share of them."""

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        if amount != amount:  # NaN: in the sum and in no bucket, as prometheus_client counts it
            super().observe(amount, exemplar)
            return
        self._raise_if_not_observable()  # type: ignore[no-untyped-call]
        self._sum.inc(amount)
        bucket = self._buckets[bisect_left(self._upper_bounds, amount)]  # (the last bound is +Inf)
        bucket.inc(1)
        if exemplar:
            bucket.set_exemplar(Exemplar(exemplar, amount, time.time()))


class _CallbackCounter(Collector):
    """A counter whose value another object keeps (a `_total` read at scrape time)."""

    def __init__(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        self._name, self._documentation, self._read = name, documentation, read

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self._name, self._documentation, value=self._read())


class BoundedLabel:
    """A label whose values are the first `limit` distinct names, then `other`; no name is `none`."""

    __slots__ = ("_seen", "limit", "listed")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: set[str] = set()
        self.listed = 0  # names that came from a server's listing, not from traffic

    def knows(self, name: str) -> bool:
        return name in self._seen

    def label(self, name: str | None) -> tuple[str, bool]:
        """The label for `name`, and whether it is a label's first use (`none` never counts)."""
        if not name:
            return NO_MODEL, False
        if name in self._seen:
            return name, False
        if len(self._seen) >= self.limit:
            name = OTHER_MODEL
            if name in self._seen:
                return name, False
        self._seen.add(name)
        return name, True


class RecordMetrics:
    """The metrics each serving process counts from its own records (one process, or each of N
    workers, whose registries the supervisor serves summed: `proxy.observers.metrics_merge`)."""

    def __init__(self, registry: CollectorRegistry | None = None, max_models: int = 50, max_clients: int = 0) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.max_models = max_models
        self._models = BoundedLabel(max_models)
        self.max_clients = max_clients
        self._clients = BoundedLabel(max_clients)
        r = self.registry
        # Per client only when asked (--client-metrics N): a bounded label, the first N then `other`.
        self.client_requests = Counter(
            "llm_proxy_client_requests", "Responses by the client that sent them (the record's `client`: a keyed "
            "hash of its API key, or --client-header's value; the first --client-metrics names, then other; none: "
            "no key) and by outcome.", ["client", "outcome"], registry=r) if max_clients > 0 else None
        # --- per response -------------------------------------------------------------------
        # Every ratio (dashboard, rules, alerts) is taken from this one counter, numerator and
        # denominator alike, so that a series appearing for the first time (a new concurrency
        # bucket, a new cause, a restart) weighs on both sides at once: no ratio exceeds 1.
        self.requests = Counter(
            "llm_proxy_requests", "Responses by how they ended: stop_reason as recorded, cause (the stop "
            "reason with length stops told by cause and upstream errors by kind), outcome (complete, budget, "
            "cut, client_gone, client_error, unknown, not_inference), reasoning (mostly: a length stop whose "
            "budget went mostly to thinking) and the concurrency bucket of the response's peak.",
            ["route", "model", "stop_reason", "cause", "outcome", "reasoning", "concurrency"], registry=r)
        self.output_tokens = Histogram(
            "llm_proxy_output_tokens", "Output tokens per answer (usage when reported, else counted); the "
            "exemplar names a recent request.", ["model", "concurrency"], buckets=TOKEN_BUCKETS, registry=r)
        self.requested_max_tokens = Summary(
            "llm_proxy_requested_max_tokens", "The output budget clients asked for (sum and count: the mean).",
            ["model"], registry=r)
        self.ttft = Histogram(
            "llm_proxy_time_to_first_token_seconds", "Time from request to the first content chunk; the "
            "exemplar names a recent request.", ["model", "concurrency"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(
            "llm_proxy_inter_token_latency_seconds", "Mean gap between content chunks, per response.",
            ["model", "concurrency"], buckets=ITL_BUCKETS, registry=r)
        self.duration = Histogram(
            "llm_proxy_request_duration_seconds", "Time from request to the end of the response, by outcome; "
            "the exemplar names a recent request.", ["outcome"], buckets=DURATION_BUCKETS, registry=r)
        self.truncated = Counter(
            "llm_proxy_truncated", "Answers the serving layer cut (outcome cut), by cause; every cause of a "
            "model exists at 0 from the moment the proxy knows the model (listed by the server, or named by "
            "an admitted request), so that its first rise alerts. For counting and alerting: ratios come "
            "from llm_proxy_requests_total.", ["model", "cause"], registry=r)
        self.prompt_truncated = Counter(
            "llm_proxy_prompt_truncated", "Answers whose prompt the server cut on the way in (Ollama dropping "
            "earlier messages past its context, llama.cpp's context shift), as the server's own numbers show; "
            "the answer itself may look complete.", ["model"], registry=r)
        self.incomplete_answers = Counter(
            "llm_proxy_incomplete_answers", "Answers to requests that asked for structure whose structured part "
            "was not whole at the end, by part: tool_call (its arguments not whole JSON, cut by the budget or "
            "broken) or json (an answer asked to be JSON that is not); each model's parts exist at 0 from the "
            "moment the proxy knows the model.", ["model", "part"], registry=r)
        self.server_tokenizer_requests = Counter(
            "llm_proxy_server_tokenizer_requests", "Length stops the wire left open (tokens only counted), by what "
            "the upstream's own tokenizer made of them: decided, undecided (counted, but too close to call), "
            "unavailable (no tokenizer the proxy knows), failed, timeout, dropped (queue full), skipped "
            "(--server-tokenizer off, or stopping).", ["result"], registry=r)
        self.server_spans = Counter(
            "llm_proxy_server_spans", "Request spans the server sent (serve --server-traces), by what became of "
            "them: joined (to the proxy's record), late (its record had gone on without it), unmatched (no record "
            "of the proxy's came for it), dropped (past the spans per second or the bound), not_request (a span "
            "that is no server's request span).", ["result"], registry=r)
        self.server_queue = Histogram(
            "llm_proxy_server_queue_seconds", "How long each request waited in the server's own queue before it "
            "was scheduled, as the server says (its span, vLLM's per-request metrics, Ollama's durations).",
            ["model"], buckets=DURATION_BUCKETS, registry=r)
        self.admission_wait = Histogram(
            "llm_proxy_admission_wait_seconds", "How long generations waited at the proxy's own admission gate "
            "(--max-in-flight) before they went upstream.", ["model"], buckets=DURATION_BUCKETS, registry=r)
        self.admission_refused = Counter(
            "llm_proxy_admission_refused", "Generations the proxy's admission gate refused with a 503: its queue "
            "was full (queue_full) or the wait ran past --queue-timeout (queue_timeout).", ["reason"], registry=r)
        self.undelivered = Counter(
            "llm_proxy_undelivered_answers", "Answers the server finished (its span says so) whose stream broke "
            "before its end: cut between the server's engine and the proxy.", ["model"], registry=r)
        self.server_after_disconnect = Histogram(
            "llm_proxy_server_after_disconnect_seconds", "How long the server went on generating after the "
            "client left, for answers it ran to their end (its span): capacity spent on no one.",
            ["model"], buckets=DURATION_BUCKETS, registry=r)
        self.client_disconnects = Counter(
            "llm_proxy_client_disconnects", "Clients that went away before the response ended.",
            ["phase"], registry=r)
        self.deadline_hits = Counter(
            "llm_proxy_deadline_hits", "Responses that passed the total deadline or the idle timeout.",
            ["kind", "mode"], registry=r)
        self.upstream_errors = Counter(
            "llm_proxy_upstream_errors", "Upstream failures by kind.", ["kind"], registry=r)
        self.upstream_retries = Counter(
            "llm_proxy_upstream_retries", "Idempotent requests (GET, HEAD, ...) sent again on a fresh "
            "connection because a pooled one broke under them; a POST is never sent twice.", registry=r)
        self.parse_errors = Counter(
            "llm_proxy_parse_errors", "Responses whose bytes the parser could not fully read.",
            ["dialect"], registry=r)
        self.exchange_failures = Counter(
            "llm_proxy_exchange_failures", "Exchanges the proxy's own code failed on, each ended at once (stop "
            "reason proxy_error: a 502 before the request went upstream, a broken connection after; the log's "
            "exchange_failed line says where): a defect of the proxy's, never the server's or the client's.",
            registry=r)
        self.observer_errors = Counter(
            "llm_proxy_observer_errors", "Observer failures (the traffic was not affected).", registry=r)
        self.invalid_requests = Counter(
            "llm_proxy_invalid_requests", "Requests refused with a 400 before any handler ran, because they "
            "are not valid HTTP (a header line over 8190 bytes, a control byte in a value), by reason.",
            ["reason"], registry=r)
        self.history_up = Gauge(
            "llm_proxy_history_up", "1 while records are written to the history database (--history), "
            "0 when it is off or cannot be written (full or read-only disk).", registry=r)
        self.history_dropped = Counter(
            "llm_proxy_history_dropped", "Records not written to the history (its writer fell behind or the "
            "database could not be written); they stay in the in-memory ring.", registry=r)
        self.trace_spans_dropped = Counter(
            "llm_proxy_trace_spans_dropped", "OpenTelemetry spans not exported (--otel): the queue was full or the "
            "OTLP endpoint failed; the traffic was not affected.", registry=r)
        self.records_lost = Counter(
            "llm_proxy_records_lost", "Records the proxy could not make or hand on: a failure of the record "
            "path (said once per kind in the log), or a worker's channel full or broken; their exchanges were "
            "relayed all the same.", registry=r)
        self._children: dict[tuple[Any, ...], Any] = {}
        # Bounded label sets are exported at 0 from the start: a series first scraped at 1 has no
        # increase that rate()/increase() can see, so the first event of a kind would go unalerted.
        for phase in ("before_first_token", "mid_stream"):
            self.client_disconnects.labels(phase)
        for kind in ("total", "idle"):
            for mode in ("observe", "enforce"):
                self.deadline_hits.labels(kind, mode)
        for error_kind in UPSTREAM_ERROR_KINDS:
            self.upstream_errors.labels(error_kind)
        for span_result in SPAN_RESULTS:
            self.server_spans.labels(span_result)
        for refusal in ("queue_full", "queue_timeout"):
            self.admission_refused.labels(refusal)

    def count_tokenizer(self, result: str) -> None:
        """One length stop through the server's tokenizer (`proxy.diagnosis.server_check`: a bounded set of results)."""
        self._child(self.server_tokenizer_requests, result).inc()

    def count_spans(self, result: str, count: int = 1) -> None:
        """Spans of the server's (`proxy.diagnosis.server_traces.RESULTS`)."""
        self._child(self.server_spans, result).inc(count)

    def count_not_admitted(self, reason: str) -> None:
        """A generation the admission gate refused (`proxy.relay.admission.Refused`: a bounded set)."""
        self._child(self.admission_refused, reason).inc()

    def count_refused(self, reason: str) -> None:
        """A request the HTTP parser refused (`proxy.relay.listeners.refusal_reason`: a bounded set)."""
        self.invalid_requests.labels(reason).inc()

    def client_label(self, client: str | None) -> str:
        """A bounded client label: the first `max_clients` distinct names, then `other`."""
        return self._clients.label(client)[0]

    def model_label(self, model: str | None) -> str:
        """A bounded model label: the first `max_models` distinct names, then `other`."""
        label, first = self._models.label(model)
        if first:
            self._start_truncation_series(label)
        return label

    def know_models(self, names: Iterable[str]) -> None:
        """Models the server lists: their cut series at 0 before any answer of theirs. At most half
        of `--max-models` go to listed names, so that a server listing many cannot take every label
        from the models the traffic uses."""
        room = self.max_models // 2 - self._models.listed
        for name in names:
            if room <= 0:
                return
            if self._models.knows(name):
                continue
            self.model_label(name)
            self._models.listed += 1
            room -= 1

    def _start_truncation_series(self, model: str) -> None:
        """A model's cut counts, every cause, and its prompt cuts at 0 from the moment the proxy
        knows the model (the server lists it, or a request names it when it is admitted): what the
        alerts watch with increase(), which sees no rise in a series born at 1 (its `_created`
        sample covers the rest, see `Created`). A model's answers by concurrency and outcome
        (`llm_proxy_requests_total`) are not made ahead: their label space is thousands of series
        a model, so /metrics grows with the traffic there, and the rules count those series from
        their `_created` time."""
        for cause in TRUNCATION_CAUSES:
            self._child(self.truncated, model, cause)
        self._child(self.prompt_truncated, model)
        for part in INCOMPLETE_PARTS:
            self._child(self.incomplete_answers, model, part)

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = metric.labels(*labels)
            self._children[key] = child
        return child


class ProcessMetrics:
    """The metrics of the proxy as a whole, read from state it already holds: what is in flight, the
    bytes held for parsing, the workers, and the GPU and upstream telemetry. One process keeps them
    beside its record metrics; with `--workers` the supervisor keeps them."""

    def __init__(self, registry: CollectorRegistry | None = None, max_models: int = 50) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.max_models = max_models  # (the upstream's loaded models exported, at most)
        r = self.registry
        self.in_flight = Gauge("llm_proxy_in_flight", "Inference requests in flight now (read from the "
                               "concurrency tracker at scrape time).", registry=r)
        self.admission_waiting = Gauge(
            "llm_proxy_admission_waiting", "Generations waiting at the proxy's admission gate now (--max-in-flight).",
            registry=r)
        self.admission_limit = Gauge(
            "llm_proxy_admission_limit", "The admission gate's limit on generations in flight (0: the gate is open).",
            registry=r)
        self.workers = Gauge(
            "llm_proxy_workers", "Processes serving the proxy port now (--workers; 1 without it).", registry=r)
        self.workers.set(1)
        # (Their names are older than --parse-bytes, and kept: dashboards and alerts read them.)
        self.parse_bytes_used = Gauge(
            "llm_proxy_parse_budget_used_bytes", "Bytes held now to read request and response bodies, "
            "process-wide (--parse-bytes bounds them).", registry=r)
        self._parse_bytes_refusals: Callable[[], float] = lambda: 0.0
        r.register(_CallbackCounter("llm_proxy_parse_budget_refusals", "Bodies passed through unread because "
                                    "the process-wide bytes held for parsing (--parse-bytes) ran out.",
                                    lambda: self._parse_bytes_refusals()))
        # --- GPU telemetry (NVML) ------------------------------------------------------------
        gpu_labels = ["gpu", "uuid", "name"]
        self.gpu_memory_used = Gauge(
            "llm_proxy_gpu_memory_used_bytes", "GPU memory in use.", gpu_labels, registry=r)
        self.gpu_memory_free = Gauge(
            "llm_proxy_gpu_memory_free_bytes", "GPU memory free.", gpu_labels, registry=r)
        self.gpu_memory_total = Gauge(
            "llm_proxy_gpu_memory_total_bytes", "GPU memory in all.", gpu_labels, registry=r)
        self.gpu_utilization = Gauge(
            "llm_proxy_gpu_utilization_ratio", "GPU utilization (0-1) over NVML's last sample period.",
            gpu_labels, registry=r)
        self.gpu_process_memory = Gauge(
            "llm_proxy_gpu_process_memory_bytes", "GPU memory used by each process.",
            ["gpu", "pid", "process"], registry=r)
        self.gpu_telemetry_up = Gauge(
            "llm_proxy_gpu_telemetry_up", "1 while NVML telemetry works, else 0.", registry=r)
        # --- the upstream server's own state -----------------------------------------------
        # Exported only while known: a figure the upstream does not report is absent, never NaN.
        self.upstream_state = UpstreamStateCollector()
        r.register(self.upstream_state)
        self.upstream_model_vram = Gauge(
            "llm_proxy_upstream_model_vram_bytes", "VRAM held by each loaded model (Ollama /api/ps).",
            ["model"], registry=r)
        self.upstream_telemetry_up = Gauge(
            "llm_proxy_upstream_telemetry_up", "1 while the upstream's state can be read, else 0.",
            ["source"], registry=r)

    def read_state(self, *, in_flight: Callable[[], float], parse_bytes_used: Callable[[], float],
                   parse_bytes_refusals: Callable[[], float], admission_waiting: Callable[[], float] = lambda: 0,
                   admission_limit: Callable[[], float] = lambda: 0) -> None:
        """Figures the process already knows, read at scrape time rather than counted twice."""
        self.in_flight.set_function(in_flight)
        self.admission_waiting.set_function(admission_waiting)
        self.admission_limit.set_function(admission_limit)
        self.parse_bytes_used.set_function(parse_bytes_used)
        self._parse_bytes_refusals = parse_bytes_refusals


class ProxyMetrics(RecordMetrics, ProcessMetrics):
    """Both in one registry: the metrics of a proxy that runs in one process."""

    def __init__(self, registry: CollectorRegistry | None = None, max_models: int = 50, max_clients: int = 0) -> None:
        RecordMetrics.__init__(self, registry, max_models, max_clients)
        ProcessMetrics.__init__(self, self.registry, max_models)


class MetricsObserver(Observer):
    """Turns each finished record into metric updates."""

    def __init__(self, metrics: RecordMetrics) -> None:
        self.metrics = metrics

    def on_response_start(self, record: ResponseRecord) -> None:
        """Admitted, its request read: a model met for the first time has its cut series at 0
        now, before its answer could be cut (a scrape during a long first answer sees the 0)."""
        if record.model:
            self.metrics.model_label(record.model)

    def on_response(self, record: ResponseRecord) -> None:
        m = self.metrics
        model = m.model_label(record.model)
        cause = record.cause
        outcome = record.outcome
        bucket = concurrency_bucket(record.concurrency_peak)
        reasoning = "mostly" if record.budget_mostly_reasoning else ""
        m._child(m.requests, record.route, model, record.stop_reason, cause, outcome, reasoning, bucket).inc()
        if m.client_requests is not None:
            m._child(m.client_requests, m.client_label(record.client), outcome).inc()
        exemplar = {"request_id": record.request_id[:64]}  # OpenMetrics: 128 characters for all labels
        m._child(m.duration, outcome).observe(record.duration_s, exemplar)
        if record.upstream_error is not None:
            m._child(m.upstream_errors, record.upstream_error).inc()
        if record.upstream_retries:
            m.upstream_retries.inc(record.upstream_retries)
        if record.parse_error:
            m._child(m.parse_errors, record.dialect).inc()
        if record.observer_errors:
            m.observer_errors.inc(len(record.observer_errors))
        if record.stop_reason == "proxy_error":
            m.exchange_failures.inc()
        if outcome == "not_inference":
            return
        if record.output_tokens is not None:
            m._child(m.output_tokens, model, bucket).observe(record.output_tokens, exemplar)
        if record.requested_max_tokens is not None:
            m._child(m.requested_max_tokens, model).observe(record.requested_max_tokens)
        if record.ttft_s is not None:
            m._child(m.ttft, model, bucket).observe(record.ttft_s, exemplar)
        if record.itl_mean_s is not None:
            m._child(m.itl, model, bucket).observe(record.itl_mean_s)
        if outcome == "cut":
            m._child(m.truncated, model, cause).inc()
        if record.prompt_truncated:
            m._child(m.prompt_truncated, model).inc()
        if record.answer_complete is False:
            m._child(m.incomplete_answers, model, record.incomplete_part or "tool_call").inc()
        if record.client_disconnected and record.disconnect_phase is not None:
            m._child(m.client_disconnects, record.disconnect_phase).inc()
        if record.deadline_hit != "none":
            m._child(m.deadline_hits, record.deadline_hit, record.deadline_mode or "observe").inc()
        if record.server_queue_s is not None:
            m._child(m.server_queue, model).observe(record.server_queue_s)
        if record.queue_time_source == "proxy" and record.queue_time_s is not None:
            m._child(m.admission_wait, model).observe(record.queue_time_s)
        if record.undelivered:
            m._child(m.undelivered, model).inc()
        if record.server_after_disconnect_s is not None:
            m._child(m.server_after_disconnect, model).observe(record.server_after_disconnect_s)


class UpstreamStateCollector(Collector):
    """The upstream server's own state, as last read (vLLM /metrics, Ollama /api/ps).

    Each figure is exported only while the upstream reports it: with a vLLM upstream there is no
    `models_loaded`, with Ollama no KV-cache usage, and nothing at all while it cannot be read.
    Preemptions are the server's own cumulative counter, exported as a counter (a server restart
    is a reset, which rate() and increase() handle).
    """

    def __init__(self) -> None:
        self.running: float | None = None
        self.waiting: float | None = None
        self.kv_cache_usage: float | None = None
        self.preemptions: float | None = None
        self.models_loaded: float | None = None
        self.request_preemptions: float | None = None
        self.requests_finished: float | None = None

    def _values(self) -> tuple[float | None, ...]:
        return (self.running, self.waiting, self.kv_cache_usage, self.preemptions, self.models_loaded,
                self.request_preemptions, self.requests_finished)

    def _set(self, values: tuple[float | None, ...]) -> None:
        (self.running, self.waiting, self.kv_cache_usage, self.preemptions, self.models_loaded,
         self.request_preemptions, self.requests_finished) = values

    def clear(self) -> None:
        self._set((None,) * 7)

    def describe(self) -> Iterator[Metric]:
        """Every family this collector may export, known or not (for the registry and for tests)."""
        saved = self._values()
        self._set((0.0,) * 7)
        try:
            yield from self.collect()
        finally:
            self._set(saved)

    def collect(self) -> Iterator[Metric]:
        gauges = (("llm_proxy_upstream_requests_running", "Requests the upstream says it is running.", self.running),
                  ("llm_proxy_upstream_requests_waiting", "Requests the upstream says are waiting.", self.waiting),
                  ("llm_proxy_upstream_kv_cache_usage_ratio", "The upstream's KV-cache usage (0-1).",
                   self.kv_cache_usage),
                  ("llm_proxy_upstream_models_loaded", "Models the upstream has loaded (Ollama /api/ps).",
                   self.models_loaded))
        for name, documentation, value in gauges:
            if value is not None:
                yield GaugeMetricFamily(name, documentation, value=value)
        if self.preemptions is not None:
            yield CounterMetricFamily("llm_proxy_upstream_preemptions", "The upstream's own cumulative count of "
                                      "preempted requests (vLLM; SGLang's retracted requests), as read.",
                                      value=self.preemptions)
        if self.request_preemptions is not None and self.requests_finished is not None:
            yield CounterMetricFamily("llm_proxy_upstream_finished_request_preemptions", "Preemptions of the "
                                      "requests the upstream finished, each counted once at its end (vLLM's "
                                      "per-request histogram, vllm:request_num_preemptions_sum).",
                                      value=self.request_preemptions)
            yield CounterMetricFamily("llm_proxy_upstream_finished_requests", "Requests the upstream finished "
                                      "(vllm:request_num_preemptions_count): the denominator of the mean "
                                      "preemptions per request.", value=self.requests_finished)
