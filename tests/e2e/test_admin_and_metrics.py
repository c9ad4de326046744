"""Concurrency tags under parallel load, the metrics exposed, and the record API."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import aiohttp
import orjson
import pytest
from prometheus_client import generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from proxy.record import ResponseRecord
from proxy.serve.app import RunningProxy
from tests.e2e.test_stop_reasons import CHAT, CHAT_URL
from tests.support.proxies import ProxyFactory, record_for
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.wire import JSON_HEADERS, openai_stream


async def test_concurrency_tags_under_parallel_requests(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                        client: aiohttp.ClientSession) -> None:
    n = 6
    upstream.push(*[Script(openai_stream(10), delay=0.03) for _ in range(n)])

    async def one(i: int) -> str:
        async with client.post(proxy.proxy_url + CHAT_URL, json=CHAT, headers={"X-Request-Id": f"par-{i}"}) as r:
            await r.read()
            return r.headers["X-LLM-Diag-Concurrency"]

    admitted = await asyncio.gather(*(one(i) for i in range(n)))
    assert sorted(int(a) for a in admitted) == list(range(1, n + 1))
    records = [await record_for(proxy, f"par-{i}") for i in range(n)]
    assert all(r.concurrency_peak == n for r in records)
    assert all(1 <= r.concurrency_mean <= n for r in records)
    assert max(r.concurrency_mean for r in records) > n - 1
    assert proxy.concurrency.in_flight == 0


async def metrics_text(client: aiohttp.ClientSession, proxy: RunningProxy) -> str:
    async with client.get(proxy.admin_url + "/metrics") as response:
        assert response.status == 200
        return (await response.read()).decode()


async def test_metrics_carry_stop_reason_cause_outcome_concurrency_and_truncation(
        upstream: ScriptedUpstream, proxy: RunningProxy, client: aiohttp.ClientSession) -> None:
    # a length stop with no budget asked: the server's own limit (server_limit, a cut); then one at the
    # client's budget (requested_budget: not a cut); then a complete answer
    upstream.push(Script(openai_stream(10, "length"), delay=0.005), Script(openai_stream(5, "length"), delay=0.005),
                  Script(openai_stream(3), delay=0.005))
    for body in (CHAT, {**CHAT, "max_tokens": 5}, CHAT):
        async with client.post(proxy.proxy_url + CHAT_URL, json=body) as response:
            await response.read()
    await asyncio.sleep(0.05)
    text = await metrics_text(client, proxy)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}

    def answers(stop: str, cause: str, outcome: str) -> float:
        return samples[("llm_proxy_requests_total", (
            ("cause", cause), ("concurrency", "1"), ("model", "m"), ("outcome", outcome), ("reasoning", ""),
            ("route", CHAT_URL), ("stop_reason", stop)))]

    assert answers("length", "server_limit", "cut") == 1
    assert answers("length", "requested_budget", "budget") == 1
    assert answers("eos", "eos", "complete") == 1
    assert samples[("llm_proxy_truncated_total", (("cause", "server_limit"), ("model", "m")))] == 1
    assert not any(name == "llm_proxy_truncated_total" and ("cause", "requested_budget") in labels
                   for name, labels in samples)  # the client's own budget is not a cut
    assert samples[("llm_proxy_in_flight", ())] == 0
    for name in ("llm_proxy_output_tokens_bucket", "llm_proxy_requested_max_tokens_sum",
                 "llm_proxy_time_to_first_token_seconds_bucket", "llm_proxy_inter_token_latency_seconds_bucket",
                 "llm_proxy_request_duration_seconds_bucket"):
        assert any(n == name for n, _ in samples), name
    # every series says when it started, so that the rules count a series born at 1 from 0
    created = {labels: value for (name, labels), value in samples.items() if name == "llm_proxy_requests_created"}
    assert len(created) == 3 and all(abs(value - time.time()) < 60 for value in created.values())
    # a model's cut series exist at 0 for every cause from its first request on
    assert samples[("llm_proxy_truncated_total", (("cause", "oom"), ("model", "m")))] == 0


async def test_openmetrics_scrapes_carry_request_ids_as_exemplars(
        upstream: ScriptedUpstream, proxy: RunningProxy, client: aiohttp.ClientSession) -> None:
    upstream.push(Script(openai_stream(4), delay=0.005))
    async with client.post(proxy.proxy_url + CHAT_URL, json=CHAT, headers={"X-Request-Id": "ex-1"}) as response:
        await response.read()
    await asyncio.sleep(0.05)
    async with client.get(proxy.admin_url + "/metrics",
                          headers={"Accept": "application/openmetrics-text; version=1.0.0"}) as response:
        assert response.headers["Content-Type"].startswith("application/openmetrics-text")
        text = (await response.read()).decode()
    exemplars = {s.name: s.exemplar for family in openmetrics_families(text) for s in family.samples if s.exemplar}
    for name in ("llm_proxy_output_tokens_bucket", "llm_proxy_time_to_first_token_seconds_bucket",
                 "llm_proxy_request_duration_seconds_bucket"):
        assert exemplars[name].labels == {"request_id": "ex-1"}, name
    async with client.get(proxy.admin_url + "/metrics") as response:  # the classic text format: no exemplars
        assert response.headers["Content-Type"].startswith("text/plain")
        assert "request_id" not in (await response.read()).decode()


async def test_figures_the_upstream_does_not_report_are_absent_never_nan(proxy: RunningProxy) -> None:
    from proxy.observers.telemetry.server_metrics import UpstreamSeries, UpstreamState

    series = UpstreamSeries(proxy.metrics)
    series.update(UpstreamState(source="vllm", running=2, waiting=0, kv_cache_usage=0.5, preemptions_total=7))
    text = generate_latest(proxy.metrics.registry).decode()
    assert "llm_proxy_upstream_models_loaded" not in text and "NaN" not in text
    assert "llm_proxy_upstream_preemptions_total 7.0" in text
    assert "# TYPE llm_proxy_upstream_preemptions_total counter" in text
    series.unknown()
    text = generate_latest(proxy.metrics.registry).decode()
    assert "llm_proxy_upstream_requests_running" not in text and "NaN" not in text


async def test_model_labels_are_capped(upstream: ScriptedUpstream, make_proxy: ProxyFactory,
                                       client: aiohttp.ClientSession) -> None:
    proxy = await make_proxy(upstream.url, max_models=2)
    for i in range(4):
        upstream.push(Script(openai_stream(1)))
        async with client.post(proxy.proxy_url + CHAT_URL, json={**CHAT, "model": f"m{i}"}) as response:
            await response.read()
    await asyncio.sleep(0.05)
    text = await metrics_text(client, proxy)
    assert 'model="m0"' in text and 'model="m1"' in text and 'model="other"' in text
    assert 'model="m3"' not in text


async def test_request_api_lists_newest_first_with_filters(upstream: ScriptedUpstream, proxy: RunningProxy,
                                                           client: aiohttp.ClientSession) -> None:
    upstream.push(Script(openai_stream(2)), Script(openai_stream(2, "length")), Script(openai_stream(2)))
    for i in range(3):
        async with client.post(proxy.proxy_url + CHAT_URL, json=CHAT, headers={"X-Request-Id": f"api-{i}"}) as r:
            await r.read()
    await record_for(proxy, "api-2")
    async with client.get(proxy.admin_url + "/api/requests") as response:
        listing = orjson.loads(await response.read())
    assert [r["request_id"] for r in listing["records"]] == ["api-2", "api-1", "api-0"]
    async with client.get(proxy.admin_url + "/api/requests?stop_reason=length&limit=5") as response:
        assert [r["request_id"] for r in orjson.loads(await response.read())["records"]] == ["api-1"]
    async with client.get(proxy.admin_url + "/api/requests/api-0") as response:
        assert orjson.loads(await response.read())["stop_reason"] == "eos"
    async with client.get(proxy.admin_url + "/api/requests/nope") as response:
        assert response.status == 404 and "error" in orjson.loads(await response.read())
    async with client.get(proxy.admin_url + "/api/requests?stop_reason=bogus") as response:
        assert response.status == 400
    async with client.get(proxy.admin_url + "/api/requests?limit=0") as response:
        assert response.status == 400


async def test_ring_stays_at_its_bound(upstream: ScriptedUpstream, make_proxy: ProxyFactory,
                                       client: aiohttp.ClientSession) -> None:
    proxy = await make_proxy(upstream.url, ring_size=3)
    for i in range(5):
        async with client.get(proxy.proxy_url + "/v1/models", headers={"X-Request-Id": f"r{i}"}) as response:
            await response.read()
    await record_for(proxy, "r4")
    assert len(proxy.store) == 3 and proxy.store.get("r0") is None and proxy.store.total == 5


async def test_admin_token_guards_the_record_api_but_not_metrics(upstream: ScriptedUpstream,
                                                                 make_proxy: ProxyFactory,
                                                                 client: aiohttp.ClientSession) -> None:
    proxy = await make_proxy(upstream.url, admin_token="s3cret")
    async with client.get(proxy.admin_url + "/api/requests") as response:
        assert response.status == 401
    async with client.get(proxy.admin_url + "/api/requests", headers={"Authorization": "Bearer s3cret"}) as r:
        assert r.status == 200
    async with client.get(proxy.admin_url + "/metrics") as response:
        assert response.status == 200


async def test_health_and_readiness(upstream: ScriptedUpstream, proxy: RunningProxy, make_proxy: ProxyFactory,
                                    client: aiohttp.ClientSession) -> None:
    async with client.get(proxy.admin_url + "/healthz") as response:
        assert response.status == 200
    async with client.get(proxy.admin_url + "/readyz") as response:
        assert response.status == 200
    # An upstream that cannot be reached does not make the proxy unready (readiness would flap with
    # every slow vLLM and pull the only replica out of its Service): the body says it, and
    # ?upstream=required asks for the old strict answer.
    down = await make_proxy("http://127.0.0.1:9")
    async with client.get(down.admin_url + "/readyz") as response:
        body = orjson.loads(await response.read())
        assert response.status == 200 and body["status"] == "ready" and body["upstream_reachable"] is False
        assert "127.0.0.1:9" in body["detail"]
    async with client.get(down.admin_url + "/readyz?upstream=required") as response:
        body = orjson.loads(await response.read())
        assert response.status == 503 and body["status"] == "not_ready"


async def test_upstream_metrics_endpoint_stays_reachable_through_the_proxy_port(
        upstream: ScriptedUpstream, proxy: RunningProxy, client: aiohttp.ClientSession) -> None:
    text = b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3\n"
    upstream.push(Script([text], headers={"Content-Type": "text/plain; version=0.0.4"}, content_length=True))
    async with client.get(proxy.proxy_url + "/metrics") as response:
        assert await response.read() == text


async def test_proxy_adds_only_its_two_headers(upstream: ScriptedUpstream, proxy: RunningProxy,
                                               client: aiohttp.ClientSession) -> None:
    headers = {**JSON_HEADERS, "X-Upstream": "1", "Server": "vllm", "Date": "Wed, 02 Dec 2026 10:00:00 GMT"}
    upstream.push(Script([b"{}"], headers=headers, content_length=True))
    async with client.get(proxy.proxy_url + "/v1/models") as response:
        await response.read()
        names = {k.lower() for k in response.headers}
    assert names == {"content-type", "x-upstream", "server", "date", "content-length", "x-request-id",
                     "x-llm-diag-concurrency"}


async def test_bounded_counters_start_at_zero_so_the_first_event_shows_in_rate(
        upstream: ScriptedUpstream, proxy: RunningProxy, client: aiohttp.ClientSession) -> None:
    upstream.push(Script(openai_stream(1)))
    async with client.post(proxy.proxy_url + CHAT_URL, json=CHAT) as response:
        await response.read()
    await asyncio.sleep(0.05)
    text = await metrics_text(client, proxy)
    assert 'llm_proxy_client_disconnects_total{phase="mid_stream"} 0.0' in text
    assert 'llm_proxy_upstream_errors_total{kind="oom"} 0.0' in text
    assert 'llm_proxy_truncated_total{cause="server_limit",model="m"} 0.0' in text


async def test_records_filter_by_cause_and_outcome_as_the_dashboard_links_ask(
        upstream: ScriptedUpstream, proxy: RunningProxy, client: aiohttp.ClientSession) -> None:
    upstream.push(Script(openai_stream(10, "length")), Script(openai_stream(5, "length")), Script(openai_stream(3)))
    for n, body in enumerate((CHAT, {**CHAT, "max_tokens": 5}, CHAT)):
        async with client.post(proxy.proxy_url + CHAT_URL, json=body, headers={"X-Request-Id": f"f{n}"}) as response:
            await response.read()
    await record_for(proxy, "f2")

    async def ids(query: str) -> list[str]:
        async with client.get(f"{proxy.admin_url}/api/requests?{query}") as response:
            assert response.status == 200, query
            return [r["request_id"] for r in orjson.loads(await response.read())["records"]]

    assert await ids("cause=server_limit") == ["f0"]
    assert await ids("outcome=budget") == ["f1"]
    assert await ids("outcome=cut&concurrency=1") == ["f0"]
    assert await ids("outcome=complete") == ["f2"]
    for bad in ("cause=length", "outcome=truncated"):
        async with client.get(f"{proxy.admin_url}/api/requests?{bad}") as response:
            assert response.status == 400, bad


async def test_an_answer_that_ended_is_in_what_the_admin_listener_answers_at_once(
        upstream: ScriptedUpstream, proxy: RunningProxy, client: aiohttp.ClientSession) -> None:
    """Finished records reach the observers in batches (`Delivery.batch_s`); whatever the admin
    listener answers comes after what waits is delivered: no answer that ended is missing."""
    upstream.push(Script(openai_stream(3)), Script(openai_stream(3)))
    for request_id in ("batch-0", "batch-1"):
        async with client.post(proxy.proxy_url + CHAT_URL, json=CHAT, headers={"X-Request-Id": request_id}) as r:
            await r.read()
    assert proxy.delivery._waiting  # the batch's wait has not passed: the request below flushes it
    async with client.get(proxy.admin_url + "/api/requests/batch-1") as response:
        assert response.status == 200 and orjson.loads(await response.read())["stop_reason"] == "eos"
    async with client.post(proxy.proxy_url + CHAT_URL, json=CHAT, headers={"X-Request-Id": "batch-2"}) as r:
        await r.read()
    text = await metrics_text(client, proxy)
    counted = sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                  if s.name == "llm_proxy_requests_total")
    assert counted == 3


async def test_records_waiting_for_their_batch_are_written_when_the_proxy_stops(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory, client: aiohttp.ClientSession, tmp_path: Path) -> None:
    upstream.push(Script(openai_stream(3)))
    proxy = await make_proxy(upstream.url, history_path=str(tmp_path / "history.sqlite3"))
    async with client.post(proxy.proxy_url + CHAT_URL, json=CHAT, headers={"X-Request-Id": "last"}) as r:
        await r.read()
    assert proxy.delivery._waiting
    await proxy.shutdown(1.0)
    with sqlite3.connect(tmp_path / "history.sqlite3") as db:
        assert db.execute("SELECT request_id FROM records").fetchall() == [("last",)]


async def test_a_streamed_answer_is_finished_with_the_batch_into_the_record_it_makes_at_once(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory, client: aiohttp.ClientSession,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The relay finishes a streamed answer that holds little with the batch (`Delivery.later`):
    its record is the one finishing at once makes. A request body past DEFERRED_MAX_BYTES is
    finished at once (what waits is bounded)."""
    from proxy.diagnosis import finish

    proxy = await make_proxy(upstream.url)
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * finish.DEFERRED_MAX_BYTES}]}
    finished: dict[str, dict[str, object]] = {}
    for name, deferred_max in (("now", -1), ("batch", finish.DEFERRED_MAX_BYTES)):
        monkeypatch.setattr(finish, "DEFERRED_MAX_BYTES", deferred_max)
        for kind, body in (("small", CHAT), ("big", big)):
            upstream.push(Script(openai_stream(40, "length"), delay=0.001))
            async with client.post(proxy.proxy_url + CHAT_URL, json=body,
                                   headers={"X-Request-Id": f"{name}-{kind}"}) as response:
                await response.read()
            waiting = list(proxy.delivery._waiting)
            deferred = any(not isinstance(item, ResponseRecord) for item in waiting)
            assert deferred == (name == "batch" and kind == "small"), (name, kind)
            record = (await record_for(proxy, f"{name}-{kind}")).to_dict()
            for moving in ("request_id", "started_at", "duration_s", "ttft_s", "itl_mean_s", "itl_p95_s",
                           "itl_max_s", "concurrency_mean"):
                record.pop(moving)
            finished[f"{name}-{kind}"] = record
    assert finished["now-small"] == finished["batch-small"]
    assert finished["now-big"] == finished["batch-big"]
    assert finished["batch-small"]["output_tokens"] == 40 and finished["batch-small"]["cause"] == "server_limit"
