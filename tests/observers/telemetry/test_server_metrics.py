"""The upstream's own state: vLLM /metrics (two engine generations), SGLang, llama.cpp, Ollama /api/ps."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import ollama
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import generate_latest
from structlog.testing import capture_logs

from proxy.observers.metrics import ProxyMetrics
from proxy.observers.telemetry.samples import SampleRing
from proxy.observers.telemetry.server_metrics import (
    LoadedModel,
    UpstreamPoller,
    UpstreamSeries,
    UpstreamState,
    parse_ollama_ps,
    parse_prometheus_state,
)
from tests.support.path_upstream import FakeUpstream

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
VLLM_V0 = (FIXTURES / "vllm_metrics_v0_engine.txt").read_text()
VLLM_V1 = (FIXTURES / "vllm_metrics_v1_engine.txt").read_text()
OLLAMA_OLD = (FIXTURES / "ollama_ps_without_context_length.json").read_bytes()
OLLAMA_NEW = (FIXTURES / "ollama_ps_with_context_length.json").read_bytes()
OLLAMA_EMPTY = (FIXTURES / "ollama_ps_nothing_loaded.json").read_bytes()


def test_vllm_v0_engine_metrics_use_gpu_cache_usage_perc_and_num_preemptions_total() -> None:
    assert parse_prometheus_state(VLLM_V0) == UpstreamState(
        source="vllm", running=7.0, waiting=3.0, kv_cache_usage=0.9375, preemptions_total=12.0,
        kv_block_size=16, kv_blocks=27910)  # its cache_config_info: the pool a request's KV blocks share


def test_vllm_v1_engine_metrics_sum_counts_over_engines_and_take_the_fullest_kv_cache() -> None:
    assert parse_prometheus_state(VLLM_V1) == UpstreamState(
        source="vllm", running=9.0, waiting=2.0, kv_cache_usage=0.81, preemptions_total=5.0)


def test_vllms_per_request_preemption_histogram_gives_preemptions_per_finished_request() -> None:
    """vllm/v1/metrics/loggers.py observes each finished request's own preemption count."""
    text = ("# TYPE vllm:request_num_preemptions histogram\n"
            'vllm:request_num_preemptions_bucket{engine="0",le="1.0",model_name="m"} 6.0\n'
            'vllm:request_num_preemptions_bucket{engine="0",le="+Inf",model_name="m"} 8.0\n'
            'vllm:request_num_preemptions_count{engine="0",model_name="m"} 8.0\n'
            'vllm:request_num_preemptions_sum{engine="0",model_name="m"} 5.0\n'
            'vllm:num_preemptions_total{engine="0",model_name="m"} 5.0\n')
    state = parse_prometheus_state(text)
    assert state is not None and (state.request_preemptions_total, state.requests_finished_total) == (5.0, 8.0)
    metrics = ProxyMetrics()
    UpstreamSeries(metrics).update(state)
    page = generate_latest(metrics.registry).decode()
    assert "llm_proxy_upstream_finished_request_preemptions_total 5.0" in page
    assert "llm_proxy_upstream_finished_requests_total 8.0" in page


def test_sglang_counts_its_retracted_requests_as_preemptions() -> None:
    """python/sglang/srt/observability/metrics_collector.py: retraction is SGLang's preemption."""
    text = ('sglang:num_running_reqs{model_name="m"} 2.0\n'
            'sglang:num_retracted_requests_total{model_name="m"} 4.0\n')
    assert parse_prometheus_state(text) == UpstreamState(source="sglang", running=2.0, preemptions_total=4.0)


def test_kv_cache_usage_perc_wins_over_the_deprecated_gpu_cache_usage_perc() -> None:
    text = ('vllm:gpu_cache_usage_perc{model_name="m"} 0.1\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.7\n')
    assert parse_prometheus_state(text).kv_cache_usage == 0.7  # type: ignore[union-attr]


def test_newer_vllm_with_only_kv_cache_usage_perc() -> None:
    text = ("# TYPE vllm:kv_cache_usage_perc gauge\n"
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n')
    state = parse_prometheus_state(text)
    assert state == UpstreamState(source="vllm", running=1.0, kv_cache_usage=0.25)


def test_sums_run_over_model_name_labels() -> None:
    text = ('vllm:num_requests_waiting{model_name="a"} 2\n'
            'vllm:num_requests_waiting{model_name="b"} 5\n')
    assert parse_prometheus_state(text).waiting == 7.0  # type: ignore[union-attr]


def test_sglang_names_map_to_running_waiting_and_token_usage() -> None:
    text = ("# HELP sglang:num_running_reqs The number of running requests.\n"
            "# TYPE sglang:num_running_reqs gauge\n"
            'sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0\n'
            "# TYPE sglang:num_queue_reqs gauge\n"
            'sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 11.0\n'
            "# TYPE sglang:token_usage gauge\n"
            'sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28\n')
    assert parse_prometheus_state(text) == UpstreamState(
        source="sglang", running=3.0, waiting=11.0, kv_cache_usage=0.28)


def test_llamacpp_without_kv_cache_gauge_reports_kv_usage_unknown() -> None:
    text = ("# HELP llamacpp:requests_processing Number of requests processing.\n"
            "# TYPE llamacpp:requests_processing gauge\n"
            "llamacpp:requests_processing 2\n"
            "# HELP llamacpp:requests_deferred Number of requests deferred.\n"
            "# TYPE llamacpp:requests_deferred gauge\n"
            "llamacpp:requests_deferred 4\n"
            "llamacpp:predicted_tokens_seconds nan\n")
    assert parse_prometheus_state(text) == UpstreamState(source="llamacpp", running=2.0, waiting=4.0)


def test_nan_values_are_unknown_not_numbers() -> None:
    text = 'vllm:num_requests_running{model_name="m"} NaN\nvllm:num_requests_waiting{model_name="m"} 1\n'
    state = parse_prometheus_state(text)
    assert state is not None and state.running is None and state.waiting == 1.0


def test_metrics_without_known_names_are_not_an_upstream_state() -> None:
    assert parse_prometheus_state("# TYPE process_cpu_seconds_total counter\n"
                                  "process_cpu_seconds_total 12.5\n") is None
    assert parse_prometheus_state("") is None


def test_malformed_metrics_line_is_a_parse_error() -> None:
    with pytest.raises(ValueError):
        parse_prometheus_state('vllm:num_requests_running{model_name="m" 3\n')


def test_ollama_ps_without_context_length() -> None:
    state = parse_ollama_ps(OLLAMA_OLD)
    assert state.source == "ollama"
    assert state.models == (
        LoadedModel("llama3.1:8b", 6654289920, 6654289920, None),
        LoadedModel("qwen2.5:32b", 23662198784, 17179869184, None),
    )


def test_ollama_ps_with_context_length() -> None:
    assert parse_ollama_ps(OLLAMA_NEW).models == (LoadedModel("gemma3:12b", 11339214848, 11339214848, 8192),)
    assert parse_ollama_ps(OLLAMA_EMPTY).models == ()


@pytest.mark.parametrize("body", [b"not json", b"[]", b'{"models": {}}', b'{"models": [1]}',
                                  b'{"models": [{"name": "x", "size": 1}]}'])
def test_ollama_ps_of_another_shape_is_a_parse_error(body: bytes) -> None:
    with pytest.raises(ValueError):
        parse_ollama_ps(body)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
        yield s


def gauge(metrics: ProxyMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def poller_for(upstream: str, session: aiohttp.ClientSession, mode: str = "auto",
               metrics: ProxyMetrics | None = None, redetect_after: int = 10) -> UpstreamPoller:
    ring: SampleRing[UpstreamState] = SampleRing(100)
    return UpstreamPoller(upstream, mode, 1.0, metrics or ProxyMetrics(), ring, session,  # type: ignore[arg-type]
                          redetect_after=redetect_after)


async def test_auto_detects_vllm_from_its_metrics_and_reexports_its_state(
        fake_upstream: FakeUpstream, session: aiohttp.ClientSession) -> None:
    fake_upstream.routes["/metrics"] = (200, VLLM_V1.encode())
    metrics = ProxyMetrics()
    poller = poller_for(fake_upstream.url, session, metrics=metrics)
    with capture_logs() as logs:
        assert await poller.detect() == "metrics_text"
    assert [e["event"] for e in logs] == ["upstream_telemetry_detected"] and logs[0]["source"] == "vllm"
    assert gauge(metrics, "llm_proxy_upstream_requests_running") == 9
    assert gauge(metrics, "llm_proxy_upstream_requests_waiting") == 2
    assert gauge(metrics, "llm_proxy_upstream_kv_cache_usage_ratio") == 0.81
    assert gauge(metrics, "llm_proxy_upstream_preemptions_total") == 5
    assert gauge(metrics, "llm_proxy_upstream_models_loaded") is None  # not reported: absent, never NaN
    assert gauge(metrics, "llm_proxy_upstream_telemetry_up", source="vllm") == 1
    fake_upstream.routes["/metrics"] = (200, VLLM_V0.encode())
    assert await poller.poll_once()
    assert gauge(metrics, "llm_proxy_upstream_preemptions_total") == 12
    assert len(poller.ring) == 2
    assert fake_upstream.hits == ["/metrics", "/metrics"]


async def test_auto_detects_ollama_from_api_ps_and_keeps_model_vram_series_bounded(
        fake_upstream: FakeUpstream, session: aiohttp.ClientSession) -> None:
    fake_upstream.routes["/api/ps"] = (200, OLLAMA_OLD)
    metrics = ProxyMetrics(max_models=1)
    poller = poller_for(fake_upstream.url, session, metrics=metrics)
    assert await poller.detect() == "loaded_models"
    assert gauge(metrics, "llm_proxy_upstream_models_loaded") == 2
    # max_models=1: only the model holding the most VRAM gets a series
    assert gauge(metrics, "llm_proxy_upstream_model_vram_bytes", model="qwen2.5:32b") == 17179869184
    assert gauge(metrics, "llm_proxy_upstream_model_vram_bytes", model="llama3.1:8b") is None
    assert gauge(metrics, "llm_proxy_upstream_requests_running") is None  # not reported: absent, never NaN
    assert gauge(metrics, "llm_proxy_upstream_telemetry_up", source="ollama") == 1
    fake_upstream.routes["/api/ps"] = (200, OLLAMA_EMPTY)
    assert await poller.poll_once()
    assert gauge(metrics, "llm_proxy_upstream_models_loaded") == 0
    text = generate_latest(metrics.registry).decode()
    assert "llm_proxy_upstream_model_vram_bytes{" not in text


async def test_auto_with_neither_endpoint_logs_one_line_and_reports_up_0(
        fake_upstream: FakeUpstream, session: aiohttp.ClientSession) -> None:
    fake_upstream.routes["/metrics"] = (200, b"process_cpu_seconds_total 1.0\n")  # not an inference server
    metrics = ProxyMetrics()
    poller = poller_for(fake_upstream.url, session, metrics=metrics)
    with capture_logs() as logs:
        assert await poller.detect() is None
        assert await poller.detect() is None
    assert [e["event"] for e in logs] == ["upstream_telemetry_unavailable"]
    assert "unrecognized" in logs[0]["reason"] and "http_404" in logs[0]["reason"]
    assert gauge(metrics, "llm_proxy_upstream_telemetry_up", source="auto") == 0


async def test_auto_on_a_port_nobody_listens_on_is_unavailable_not_an_exception(
        session: aiohttp.ClientSession) -> None:
    with capture_logs() as logs:
        assert await poller_for("http://127.0.0.1:9", session).detect() is None
    assert "connect" in logs[0]["reason"]


async def test_failing_polls_set_up_0_and_unknown_gauges_log_once_and_recover(
        fake_upstream: FakeUpstream, session: aiohttp.ClientSession) -> None:
    fake_upstream.routes["/metrics"] = (200, VLLM_V0.encode())
    metrics = ProxyMetrics()
    poller = poller_for(fake_upstream.url, session, mode="vllm", metrics=metrics)
    with capture_logs() as logs:
        assert await poller.poll_once()
        fake_upstream.routes["/metrics"] = (500, b"boom")
        assert not await poller.poll_once()
        assert not await poller.poll_once()
        assert gauge(metrics, "llm_proxy_upstream_telemetry_up", source="vllm") == 0
        assert gauge(metrics, "llm_proxy_upstream_requests_running") is None  # not reported: absent, never NaN
        fake_upstream.routes["/metrics"] = (200, VLLM_V0.encode())
        assert await poller.poll_once()
    assert [(e["event"], e.get("error")) for e in logs] == [
        ("upstream_telemetry_error", "http_500"), ("upstream_telemetry_recovered", None)]
    assert gauge(metrics, "llm_proxy_upstream_telemetry_up", source="vllm") == 1
    assert len(poller.ring) == 2


async def test_auto_redetects_after_repeated_failures(
        fake_upstream: FakeUpstream, session: aiohttp.ClientSession) -> None:
    fake_upstream.routes["/metrics"] = (200, VLLM_V0.encode())
    poller = poller_for(fake_upstream.url, session, redetect_after=2)
    assert await poller.detect() == "metrics_text"
    del fake_upstream.routes["/metrics"]
    fake_upstream.routes["/api/ps"] = (200, OLLAMA_NEW)  # another server on the same port
    assert not await poller.poll_once()
    assert poller.kind == "metrics_text"
    assert not await poller.poll_once()
    assert poller.kind is None
    assert await poller.detect() == "loaded_models"


async def test_malformed_metrics_is_a_parse_error_logged_once(
        fake_upstream: FakeUpstream, session: aiohttp.ClientSession) -> None:
    fake_upstream.routes["/metrics"] = (200, b'vllm:num_requests_running{model_name="m" 3\n')
    poller = poller_for(fake_upstream.url, session, mode="vllm")
    with capture_logs() as logs:
        assert not await poller.poll_once()
        assert not await poller.poll_once()
    assert [e["error"] for e in logs] == ["parse"]


@pytest.mark.parametrize("body", [OLLAMA_OLD, OLLAMA_NEW, OLLAMA_EMPTY])
async def test_ollama_fixtures_are_what_the_official_client_reads(fake_upstream: FakeUpstream,
                                                                  body: bytes) -> None:
    fake_upstream.routes["/api/ps"] = (200, body)
    response = await ollama.AsyncClient(host=fake_upstream.url).ps()
    ours = parse_ollama_ps(body).models
    assert [(m.model, m.size, m.size_vram, m.context_length) for m in response.models] == \
        [(m.name, m.size_bytes, m.vram_bytes, m.context_length) for m in ours]


async def test_a_restarted_server_is_read_again_within_one_poll_interval(session: aiohttp.ClientSession) -> None:
    """vLLM restarted: connection refused for a while, then the same server answers again."""
    interval = 0.1
    first = FakeUpstream()
    await first.start()
    first.routes["/metrics"] = (200, VLLM_V0.encode())
    assert first.server is not None
    port = first.server.port
    ring: SampleRing[UpstreamState] = SampleRing(1000)
    poller = UpstreamPoller(first.url, "auto", interval, ProxyMetrics(), ring, session, redetect_after=3)
    task = asyncio.create_task(poller.run())
    try:
        while not len(ring):
            await asyncio.sleep(0.01)
        await first.server.close()
        await asyncio.sleep(10 * interval)  # many failed polls: connection refused
        assert poller.kind == "metrics_text"  # a restart is the same server: no re-detection needed
        seen = len(ring)
        second = FakeUpstream()
        second.routes["/metrics"] = (200, VLLM_V0.encode())
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", second._handle)
        second.server = TestServer(app, host="127.0.0.1", port=port)
        await second.server.start_server()
        back_at = time.monotonic()
        while len(ring) == seen:
            await asyncio.sleep(0.005)
        assert time.monotonic() - back_at <= interval + 0.1
        await second.server.close()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
