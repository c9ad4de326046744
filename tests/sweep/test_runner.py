"""The sweep's load client against real aiohttp servers on loopback: closed loop, ids, measures, join."""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from proxy.serve.app import RunningProxy
from proxy.sweep.runner import SweepError, SweepPlan, request_body, run_level, run_sweep
from tests.support.proxies import ProxyFactory
from tests.support.scripted_upstream import Script, ScriptedUpstream
from tests.support.sweep_upstream import LoadUpstream, running_load
from tests.support.wire import openai_stream


@pytest.fixture
async def load() -> AsyncIterator[LoadUpstream]:
    async with running_load() as server:
        yield server

def plan(target: str, **overrides: object) -> SweepPlan:
    base = {"target": target, "levels": (1, 3), "repeats": 2, "prompt": "hi", "max_tokens": 10, "seed": 7,
            "model": "m", "timeout_s": 10.0, "warmup": 0}
    base.update(overrides)
    return SweepPlan(**base)  # type: ignore[arg-type]


def test_openai_body_is_one_streaming_chat_request_with_budget_seed_and_usage() -> None:
    body = orjson.loads(request_body(plan("http://x", temperature=0.5)))
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
                    "seed": 7, "temperature": 0.5, "stream": True, "stream_options": {"include_usage": True}}


def test_ollama_body_puts_budget_and_seed_in_options() -> None:
    body = orjson.loads(request_body(plan("http://x", dialect="ollama")))
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                    "options": {"num_predict": 10, "seed": 7, "temperature": 0.0}}


async def test_closed_loop_keeps_exactly_level_requests_in_flight_and_sends_level_times_repeats(
        load: LoadUpstream) -> None:
    load.token_delay = 0.01
    async with aiohttp.ClientSession() as session:
        samples = await run_level(session, plan(load.url, repeats=3), 4)
    assert len(samples) == 12 and load.peak == 4
    assert [s.index for s in samples] == list(range(12))
    assert max(s.client.in_flight_at_start for s in samples) == 4


async def test_every_request_is_identical_and_carries_its_own_request_id(load: LoadUpstream) -> None:
    samples = (await run_sweep(plan(load.url))).samples
    assert len(samples) == 1 * 2 + 3 * 2
    assert len(set(load.bodies)) == 1
    assert sorted(load.request_ids) == sorted(s.request_id for s in samples)
    assert len(set(load.request_ids)) == len(samples)
    assert {s.level for s in samples} == {1, 3}


async def test_client_side_records_carry_the_stop_reason_tokens_and_timing(load: LoadUpstream) -> None:
    samples = (await run_sweep(plan(load.url, levels=(1,), repeats=3))).samples
    for s in samples:
        r = s.record
        assert s.record_source == "client" and s.join_note is None
        assert (r.stop_reason, r.output_tokens, r.tokens_source, r.status) == ("eos", 6, "usage", 200)
        assert r.requested_max_tokens == 10 and r.seed == 7
        assert r.ttft_s is not None and 0 < r.ttft_s <= r.duration_s
        assert r.itl_mean_s is not None and r.itl_mean_s > 0
        assert s.client.chunks == 6 and s.client.error is None


async def test_a_length_stop_below_the_budget_under_load_is_a_server_limit(load: LoadUpstream) -> None:
    load.answer = lambda in_flight: (6, "stop") if in_flight <= 1 else (3, "length")
    load.token_delay = 0.01
    samples = (await run_sweep(plan(load.url, levels=(1, 4), repeats=2))).samples
    by_level = {lvl: [s.record for s in samples if s.level == lvl] for lvl in (1, 4)}
    assert {r.stop_reason for r in by_level[1]} == {"eos"}
    cut = [r for r in by_level[4] if r.stop_reason == "length"]
    assert cut and all(r.length_cause == "server_limit" and r.output_tokens == 3 for r in cut)


async def test_a_length_stop_at_the_budget_is_the_requested_budget(load: LoadUpstream) -> None:
    load.answer = lambda in_flight: (10, "length")
    samples = (await run_sweep(plan(load.url, levels=(1,), repeats=1))).samples
    assert (samples[0].record.stop_reason, samples[0].record.length_cause) == ("length", "requested_budget")


async def test_a_429_is_recorded_as_rejected(load: LoadUpstream) -> None:
    load.reject_above = 1
    load.token_delay = 0.01
    samples = (await run_sweep(plan(load.url, levels=(3,), repeats=1))).samples
    rejected = [s for s in samples if s.record.stop_reason == "rejected"]
    assert rejected and all(s.record.status == 429 and s.client.status == 429 for s in rejected)


async def test_ollama_ndjson_is_parsed_client_side(load: LoadUpstream) -> None:
    samples = (await run_sweep(plan(load.url, dialect="ollama", levels=(2,), repeats=1))).samples
    assert [(s.record.stop_reason, s.record.output_tokens) for s in samples] == [("eos", 6), ("eos", 6)]


async def test_a_response_slower_than_the_timeout_is_a_client_disconnect(load: LoadUpstream) -> None:
    load.token_delay = 0.2
    samples = (await run_sweep(plan(load.url, levels=(1,), repeats=1, timeout_s=0.3))).samples
    r = samples[0].record
    assert (r.stop_reason, r.client_disconnected) == ("client_disconnect", True)
    assert samples[0].client.error is not None and "--timeout" in samples[0].client.error


async def test_warmup_requests_are_sent_but_not_recorded(load: LoadUpstream) -> None:
    samples = (await run_sweep(plan(load.url, levels=(1,), repeats=1, warmup=2))).samples
    assert len(samples) == 1 and len(load.request_ids) == 3
    assert load.request_ids[2] == samples[0].request_id  # the two before it were the warm-up


async def test_a_target_that_is_down_is_one_clear_error() -> None:
    with pytest.raises(SweepError, match=r"^cannot reach the target at http://127\.0\.0\.1:9: "):
        await run_sweep(plan("http://127.0.0.1:9"))


async def test_with_admin_each_response_is_joined_with_the_proxys_record(
        load: LoadUpstream, make_proxy: ProxyFactory) -> None:
    load.answer = lambda in_flight: (6, "stop") if in_flight <= 1 else (3, "length")
    load.token_delay = 0.01
    proxy: RunningProxy = await make_proxy(load.url)
    samples = (await run_sweep(plan(proxy.proxy_url, admin=proxy.admin_url, levels=(1, 2), repeats=2))).samples
    assert all(s.record_source == "proxy" and s.join_note is None for s in samples)
    assert all(s.record.request_id == s.request_id for s in samples)
    assert {s.record.stop_reason for s in samples if s.level == 1} == {"eos"}
    assert max(s.record.concurrency_peak for s in samples if s.level == 2) == 2
    assert any(s.record.length_cause == "server_limit" for s in samples if s.level == 2)


async def test_an_admin_that_is_down_is_one_clear_error(load: LoadUpstream) -> None:
    message = "cannot reach the proxy's admin API at http://127.0.0.1:9/healthz"
    with pytest.raises(SweepError, match=re.escape(message)):
        await run_sweep(plan(load.url, admin="http://127.0.0.1:9"))


async def test_a_request_the_target_refuses_stops_the_sweep_with_its_error(load: LoadUpstream) -> None:
    message = "the target refused the sweep's request (POST " + load.url + "/api/chat): HTTP 404"
    load.missing_model = True
    with pytest.raises(SweepError, match=re.escape(message) + ".*model 'm' not found.*check --model"):
        await run_sweep(plan(load.url, dialect="ollama", warmup=1))


async def test_a_stream_cut_mid_way_is_an_upstream_disconnect(upstream: ScriptedUpstream) -> None:
    upstream.push(Script(chunks=openai_stream(8)[:4], end="reset", method="POST"))  # GETs: the default answer
    samples = (await run_sweep(plan(upstream.url, levels=(1,), repeats=1))).samples
    record = samples[0].record
    assert (record.stop_reason, record.output_tokens, record.tokens_source) == ("upstream_disconnect", 3, "counted")
    assert samples[0].client.error is not None and "connection broke" in samples[0].client.error


async def test_request_ids_are_uuids_that_every_server_accepts(load: LoadUpstream) -> None:
    load.uuid_ids_only = True
    samples = (await run_sweep(plan(load.url, levels=(1, 2), repeats=1))).samples
    assert [s.record.status for s in samples] == [200, 200, 200]
    assert all(str(uuid.UUID(rid)) == rid for rid in load.request_ids)


async def test_a_server_that_refuses_the_id_header_is_swept_without_it(load: LoadUpstream) -> None:
    load.refuse_ids = True  # found out during the warm-up
    run = await run_sweep(plan(load.url, levels=(1,), repeats=2, warmup=1))
    assert [s.record.stop_reason for s in run.samples] == ["eos", "eos"]
    assert load.request_ids[-2:] == ["", ""]
    assert any("refused requests carrying X-Request-Id" in note for note in run.notes)


async def test_a_prompt_over_the_context_at_warm_up_is_a_finding_not_a_flag_error(load: LoadUpstream) -> None:
    load.prompt_too_long = True
    run = await run_sweep(plan(load.url, levels=(1, 2), repeats=2, warmup=1))
    assert {(s.record.status, s.record.upstream_error) for s in run.samples} == {(400, "exceeds_context")}
