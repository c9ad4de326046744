"""The upstream server's own view of its load: vLLM-style `/metrics`, or a list of the models it runs
(Ollama's `/api/ps`, LM Studio's `/api/v0/models`).

Parsing is pure (text or JSON in, `UpstreamState` out); the poller does the HTTP, keeps
the states in a ring and re-exports them through the `llm_proxy_upstream_*` gauges.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal
from urllib.parse import quote

import aiohttp
import orjson
import structlog
from prometheus_client.parser import text_string_to_metric_families

from proxy.observers.metrics import ProcessMetrics
from proxy.observers.telemetry.samples import SampleRing
from proxy.servers import SERVERS, lmstudio, server_of
from proxy.servers.answers import AnswerTooLarge, read_whole
from proxy.servers.base import MetricNames, TelemetryRead
from proxy.servers.llamacpp import SERVER as LLAMACPP
from proxy.servers.llamacpp import is_router, loaded_models
from proxy.servers.ollama import SERVER as OLLAMA
from proxy.servers.vllm import SERVER as VLLM

_log = structlog.get_logger("llm_diag_proxy.telemetry")
OLLAMA_PS = "/api/ps"
OLLAMA_KIND = OLLAMA.kind  # the source label of a list of loaded models
VLLM_KIND = VLLM.kind  # the label said of a metrics page not read yet

MAX_BODY_BYTES = 16 * 1024 * 1024
ROUTER_MODELS_MAX = 8  # models of a llama.cpp router whose /metrics are read each poll


# Each server's metric names are in its own module (proxy.servers): vLLM, SGLang, llama.cpp.
SERVER_FAMILIES: dict[str, MetricNames] = {server.kind: server.metric_names for server in SERVERS
                                           if server.metric_names is not None}
_WANTED = frozenset(name for names in SERVER_FAMILIES.values()
                    for group in (names.running, names.waiting, names.kv_cache_usage, names.preemptions,
                                  names.request_preemptions, names.requests_finished)
                    for name in group) | {"vllm:cache_config_info"}
# vLLM's KV cache as configured, in the labels of an info gauge (vllm/v1/metrics/loggers.py; the
# labels are CacheConfig.metrics_info(): every field as text, num_gpu_blocks once known).
CACHE_CONFIG_INFO = "vllm:cache_config_info"


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """One model Ollama holds in memory (`/api/ps`)."""

    name: str
    size_bytes: int
    vram_bytes: int
    context_length: int | None


@dataclass(frozen=True, slots=True)
class UpstreamState:
    """What the upstream said about itself at one moment; None where it does not say.

    Across label sets (model_name, engine, ranks) counts are summed and the KV-cache
    usage is the maximum, since an engine that is full is what queues requests.
    """

    source: str  # the server kind that said it: vllm | sglang | llamacpp | ollama | lmstudio
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    preemptions_total: float | None = None
    request_preemptions_total: float | None = None  # preemptions counted by the requests that finished
    requests_finished_total: float | None = None
    models: tuple[LoadedModel, ...] = ()
    lists_models: bool = False  # a list of loaded models (Ollama's /api/ps), not a metrics page
    kv_block_size: int | None = None  # tokens per KV-cache block (vLLM's cache_config_info)
    kv_blocks: int | None = None  # blocks in its KV-cache pool
    loaded: tuple[str, ...] | None = None  # the models it runs now, where it says (Ollama, a llama.cpp router,
    # LM Studio)


def _sample_lines(text: str) -> str:
    """Only the sample lines of the metrics we read: vLLM's page is mostly histogram buckets."""
    kept = []
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        end = len(line)
        for stop in ("{", " "):
            found = line.find(stop)
            if found != -1:
                end = min(end, found)
        if line[:end] in _WANTED:
            kept.append(line)
    return "\n".join(kept) + "\n"


def parse_prometheus_state(text: str) -> UpstreamState | None:
    """The state in a vLLM / SGLang / llama.cpp `/metrics` page; None if none of it is there.

    Raises ValueError on a line the Prometheus text parser rejects.
    """
    values: dict[str, list[float]] = {}
    block_size = blocks = None
    for family in text_string_to_metric_families(_sample_lines(text)):
        for sample in family.samples:
            if sample.name == CACHE_CONFIG_INFO:
                block_size = _label_count(sample.labels.get("block_size")) or block_size
                blocks = _label_count(sample.labels.get("num_gpu_blocks")) or blocks
            elif sample.name in _WANTED and not math.isnan(sample.value):
                values.setdefault(sample.name, []).append(float(sample.value))
    for source, names in SERVER_FAMILIES.items():
        if not any(name in values for group in (names.running, names.waiting, names.kv_cache_usage,
                                                names.preemptions) for name in group):
            continue

        def first(group: tuple[str, ...], combine: Callable[[list[float]], float]) -> float | None:
            for name in group:
                if name in values:
                    return combine(values[name])
            return None

        return UpstreamState(
            source=source,
            running=first(names.running, sum),
            waiting=first(names.waiting, sum),
            kv_cache_usage=first(names.kv_cache_usage, max),
            preemptions_total=first(names.preemptions, sum),
            request_preemptions_total=first(names.request_preemptions, sum),
            requests_finished_total=first(names.requests_finished, sum),
            kv_block_size=block_size, kv_blocks=blocks,
        )
    return None


def _label_count(value: str | None) -> int | None:
    """A positive count in a label's text ("None" and others: not said)."""
    return int(value) if value is not None and value.isdigit() and 0 < int(value) < 1 << 40 else None


def combined(states: list[UpstreamState], source: str) -> UpstreamState:
    """Several instances' states as one server's (a llama.cpp router's models): counts summed, the
    KV-cache usage the highest, a figure none reports left unknown."""
    def total(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return sum(known) if known else None

    usages = [s.kv_cache_usage for s in states if s.kv_cache_usage is not None]
    return UpstreamState(source=source, running=total([s.running for s in states]) if states else 0.0,
                         waiting=total([s.waiting for s in states]) if states else 0.0,
                         kv_cache_usage=max(usages) if usages else None,
                         preemptions_total=total([s.preemptions_total for s in states]))


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse_ollama_ps(body: bytes) -> UpstreamState:
    """The models in an Ollama `GET /api/ps` body (api/types.go, ProcessResponse).

    `context_length` exists only in newer Ollama versions and is None where missing.
    Raises ValueError when the body is not that shape.
    """
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("models"), list):
        raise ValueError("no 'models' list")
    models = []
    for item in data["models"]:
        if not isinstance(item, dict):
            raise ValueError("a 'models' entry is not an object")
        name = item.get("name") or item.get("model")
        size, vram = _int(item.get("size")), _int(item.get("size_vram"))
        if not isinstance(name, str) or size is None or vram is None:
            raise ValueError("a 'models' entry lacks name, size or size_vram")
        models.append(LoadedModel(name, size, vram, _int(item.get("context_length"))))
    names = tuple(dict.fromkeys(name for item in data["models"] if isinstance(item, dict)
                                for name in (item.get("name"), item.get("model")) if isinstance(name, str)))
    return UpstreamState(source=OLLAMA_KIND, lists_models=True, models=tuple(models), loaded=names)


class UpstreamSeries:
    """Re-exports the newest state; a figure the upstream does not report is absent, not 0 or NaN."""

    def __init__(self, metrics: ProcessMetrics) -> None:
        self.m = metrics
        self._models: set[str] = set()
        self._up_source: str | None = None

    def unknown(self) -> None:
        self.m.upstream_state.clear()
        self._set_models(())

    def update(self, state: UpstreamState) -> None:
        exported = self.m.upstream_state
        exported.running, exported.waiting = state.running, state.waiting
        exported.kv_cache_usage, exported.preemptions = state.kv_cache_usage, state.preemptions_total
        exported.request_preemptions = state.request_preemptions_total
        exported.requests_finished = state.requests_finished_total
        if state.lists_models:
            exported.models_loaded = len(state.models)
            self._set_models(state.models)
        else:
            exported.models_loaded = None
            self._set_models(())

    def _set_models(self, models: tuple[LoadedModel, ...]) -> None:
        largest = sorted(models, key=lambda x: -x.vram_bytes)[: self.m.max_models]
        names = set()
        for model in largest:
            names.add(model.name)
            self.m.upstream_model_vram.labels(model.name).set(model.vram_bytes)
        for gone in self._models - names:
            with contextlib.suppress(KeyError):
                self.m.upstream_model_vram.remove(gone)
        self._models = names

    def up(self, source: str, value: int) -> None:
        """Set `upstream_telemetry_up{source}`, keeping only the current source's series."""
        if self._up_source is not None and self._up_source != source:
            with contextlib.suppress(KeyError):
                self.m.upstream_telemetry_up.remove(self._up_source)
        self._up_source = source
        self.m.upstream_telemetry_up.labels(source).set(value)


class UpstreamFetchError(Exception):
    """A poll that got no usable answer; `kind` is short and bounded, for log-once."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


# Failures where the server answered, but not with what we read: another server may now hold the port.
_MISMATCH_KINDS = frozenset({"parse", "unrecognized", "http_404", "too_large"})


class UpstreamPoller:
    """Polls the upstream's own state every `interval_s` into `ring`.

    `mode` auto detects once (vLLM-style `/metrics`, else Ollama `/api/ps`, else nothing,
    said in one log line) and re-detects every `redetect_s` while nothing was ever found.
    A failed poll is retried at the same interval, so telemetry is back within one interval
    of a restarted server answering again. The kind found is kept through connection
    failures (a restart is the same server); only `redetect_after` answers in a row that are
    not what that kind serves make auto mode detect again. Failures are logged once per kind.
    """

    def __init__(self, upstream: str, mode: Literal["auto", "vllm", "ollama"], interval_s: float,
                 metrics: ProcessMetrics, ring: SampleRing[UpstreamState], session: aiohttp.ClientSession,
                 redetect_s: float = 30.0, redetect_after: int = 10,
                 clock: Callable[[], float] = time.time) -> None:
        self.upstream = upstream.rstrip("/")
        self.mode = mode
        self.interval_s = interval_s
        self.redetect_s = redetect_s
        self.redetect_after = redetect_after
        self.ring = ring
        self.session = session
        self.clock = clock
        self.series = UpstreamSeries(metrics)
        self.kind: TelemetryRead | None = None if mode == "auto" else server_of(mode).telemetry_read
        self.router: bool | None = None  # llama.cpp's router: /metrics per loaded model (None: not known)
        self.lists_at: str | None = None  # where the list of loaded models was read: /api/ps, LM Studio's
        self._logged: set[str] = set()
        self._failures = 0
        self._mismatches = 0  # failed polls in a row where the server answered something else
        self._up = False
        self._ever_read = False

    async def _get(self, path: str) -> bytes:
        url = self.upstream + path
        try:
            # (the session's total timeout bounds the request and the whole read)
            async with self.session.get(url, allow_redirects=False) as resp:
                if resp.status != 200:
                    raise UpstreamFetchError(f"http_{resp.status}", f"GET {path} answered {resp.status}")
                return await read_whole(resp, MAX_BODY_BYTES)  # (a page in several reads is read whole)
        except AnswerTooLarge:
            raise UpstreamFetchError("too_large", f"GET {path} body over {MAX_BODY_BYTES} bytes") from None
        except TimeoutError:
            raise UpstreamFetchError("timeout", f"GET {path} timed out") from None
        except aiohttp.ClientError as exc:
            raise UpstreamFetchError("connect", f"GET {path}: {type(exc).__name__}: {exc}"[:300]) from None

    async def _metrics(self, path: str) -> UpstreamState:
        body = await self._get(path)
        try:
            state = parse_prometheus_state(body.decode("utf-8", errors="replace"))
        except (ValueError, IndexError, KeyError) as exc:  # the text parser's ways of refusing
            raise UpstreamFetchError("parse", f"/metrics: {exc}"[:300]) from None
        if state is None:
            raise UpstreamFetchError("unrecognized", "/metrics has no vllm:, sglang: or llamacpp: "
                                                     "request/KV-cache metrics")
        return state

    async def _is_router(self) -> bool:
        """Whether the upstream is llama-server in router mode (`/props` says `role: router`)."""
        try:
            props = orjson.loads(await self._get("/props"))
        except (UpstreamFetchError, orjson.JSONDecodeError):
            return False
        return is_router(props)

    async def _router_state(self) -> UpstreamState:
        """A llama.cpp router's state: each loaded model's own `/metrics?model=` (`autoload=false`, so
        that a read never loads a model), added up."""
        try:
            listing = orjson.loads(await self._get("/v1/models"))
        except orjson.JSONDecodeError:
            raise UpstreamFetchError("parse", "/v1/models of the llama.cpp router is not JSON") from None
        names = loaded_models(listing)
        states = [await self._metrics(f"/metrics?model={quote(name, safe='')}&autoload=false")
                  for name in names[:ROUTER_MODELS_MAX]]
        return replace(combined(states, LLAMACPP.kind), loaded=tuple(names))

    async def fetch(self, kind: TelemetryRead) -> UpstreamState:
        """One read of the upstream's state; raises UpstreamFetchError."""
        if kind == "metrics_text":
            if self.router:
                return await self._router_state()
            try:
                return await self._metrics("/metrics")
            except UpstreamFetchError as exc:
                # A llama.cpp router answers a bare /metrics 400 ("model name is missing").
                if exc.kind != "http_400" or self.router is False or not await self._is_router():
                    self.router = False if exc.kind == "http_400" else self.router
                    raise
            self.router = True
            return await self._router_state()
        if self.lists_at == lmstudio.MODELS_PATH:
            return await self._lmstudio_state()
        try:
            return await self._ollama_state()
        except UpstreamFetchError as exc:
            if exc.kind != "http_404" or self.lists_at == OLLAMA_PS:
                raise
        return await self._lmstudio_state()  # no /api/ps: LM Studio's own list, perhaps

    async def _ollama_state(self) -> UpstreamState:
        body = await self._get(OLLAMA_PS)
        try:
            state = parse_ollama_ps(body)
        except ValueError as exc:
            raise UpstreamFetchError("parse", f"{OLLAMA_PS}: {exc}") from None
        self.lists_at = OLLAMA_PS
        return state

    async def _lmstudio_state(self) -> UpstreamState:
        """LM Studio's list of its models (`/api/v0/models`): which it runs now, nothing more."""
        body = await self._get(lmstudio.MODELS_PATH)
        try:
            names = lmstudio.loaded_models(orjson.loads(body))
        except (orjson.JSONDecodeError, ValueError) as exc:
            raise UpstreamFetchError("parse", f"{lmstudio.MODELS_PATH}: {exc}"[:300]) from None
        self.lists_at = lmstudio.MODELS_PATH
        return UpstreamState(source=lmstudio.KIND, loaded=names)

    async def detect(self) -> TelemetryRead | None:
        """Which of the two the upstream serves: /metrics first (vLLM names), then /api/ps."""
        reasons = []
        kinds: tuple[TelemetryRead, ...] = ("metrics_text", "loaded_models")
        for kind in kinds:
            try:
                state = await self.fetch(kind)
            except UpstreamFetchError as exc:
                reasons.append(str(exc))
                continue
            self.kind = kind
            _log.info("upstream_telemetry_detected", source=state.source, upstream=self.upstream)
            self._store(state)
            return kind
        self.series.up("auto", 0)
        if "detect" not in self._logged:
            self._logged.add("detect")
            _log.warning("upstream_telemetry_unavailable", upstream=self.upstream, reason="; ".join(reasons),
                         note=f"neither vLLM-style /metrics nor a list of loaded models (Ollama's /api/ps, "
                              f"LM Studio's /api/v0/models) answered; "
                              f"trying again every {self.redetect_s:g} s")
        return None

    def _store(self, state: UpstreamState) -> None:
        self.ring.append(self.clock(), state)
        self.series.update(state)
        self.series.up(state.source, 1)
        if not self._up and self._failures:
            _log.info("upstream_telemetry_recovered", source=state.source, after_failed_polls=self._failures)
        self._up = True
        self._ever_read = True
        self._failures = 0
        self._mismatches = 0

    async def poll_once(self) -> bool:
        """One poll of the known kind; True on success."""
        assert self.kind is not None
        try:
            state = await self.fetch(self.kind)
        except UpstreamFetchError as exc:
            self._failures += 1
            self._mismatches = self._mismatches + 1 if exc.kind in _MISMATCH_KINDS else 0
            self._up = False
            self.series.unknown()
            self.series.up(self._list_source() if self.kind == "loaded_models" else self._metrics_source(), 0)
            if exc.kind not in self._logged:
                self._logged.add(exc.kind)
                _log.warning("upstream_telemetry_error", upstream=self.upstream, error=exc.kind,
                             detail=str(exc))
            if self.mode == "auto" and self._mismatches >= self.redetect_after:
                self.kind = None
                self.router = self.lists_at = None
            return False
        self._store(state)
        return True

    def _list_source(self) -> str:
        return lmstudio.KIND if self.lists_at == lmstudio.MODELS_PATH else OLLAMA_KIND

    def _metrics_source(self) -> str:
        latest = self.ring.latest()
        if latest is not None and not latest[1].lists_models:
            return latest[1].source
        return VLLM_KIND

    async def run(self) -> None:
        self.series.unknown()
        while True:
            if self.kind is not None:
                await self.poll_once()
            elif await self.detect() is None:
                # Nothing was ever found: look again now and then. Something was, and another
                # server answers now: look again at the poll interval.
                await asyncio.sleep(self.interval_s if self._ever_read else self.redetect_s)
                continue
            await asyncio.sleep(self.interval_s)
