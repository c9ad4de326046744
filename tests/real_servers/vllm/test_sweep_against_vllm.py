"""`llm-diag-proxy sweep` through the proxy against a real vLLM: the verdict names the real cause."""

from __future__ import annotations

import pytest

from tests.real_servers.vllm.sweep_demo import LONG_PROMPT, SHORT_PROMPT, sweep
from tests.real_servers.vllm.vllm_server import MAX_MODEL_LEN, VllmServer

pytestmark = pytest.mark.vllm


async def test_preemption_without_truncation_is_no_load_effect_naming_the_preemptions(vllm: VllmServer) -> None:
    # A record claims a preemption only when two polls of vLLM's /metrics bracket it inside the
    # request's life. On two busy cores /metrics can stall past the poller's timeout while vLLM
    # preempts (or the level's answers come from its prefix cache and need no preemption), so
    # the sweep runs again, at most six times, until a record at concurrency 8 claims one. (Seen:
    # a sweep whose level-8 polls all stalled, every record there without server figures; in
    # six instrumented sweeps, two had no record claim one.)
    # A sweep where vLLM closed a connection with a request on it, unanswered, goes again too: the
    # record says so (502 `reset`), and it is no cut of an answer (seen in about one sweep
    # in four, at level 8; see docs/reliability.md section).
    tried: list[str] = []
    for _ in range(6):
        outcome, printed = await sweep(vllm, SHORT_PROMPT, levels=(1, 2, 4, 8))
        unanswered = [s.record for s in outcome.samples if s.record.stop_reason == "upstream_error"]
        assert all((r.status, r.upstream_error) == (502, "reset") for r in unanswered)
        if unanswered:
            tried.append(f"{len(unanswered)} unanswered")
            continue
        assert {s.record.stop_reason for s in outcome.samples} == {"eos"}
        assert all(s.record_source == "proxy" for s in outcome.samples)
        top = [s.record for s in outcome.samples if s.level == 8]
        if any((r.preemptions_during or 0) > 0 for r in top):
            break
        tried.append(f"preemptions_during at level 8: {sorted({r.preemptions_during for r in top}, key=str)}")
    else:
        raise AssertionError(f"no record at concurrency 8 saw a preemption in six sweeps: {tried}")
    verdict = outcome.verdict
    assert verdict.kind == "no_load_effect"
    assert any("preempted" in line for line in verdict.evidence), verdict.evidence
    assert "VERDICT (no_load_effect)" in printed


async def test_a_context_that_clamps_every_answer_is_named_at_concurrency_one(vllm: VllmServer) -> None:
    outcome, printed = await sweep(vllm, LONG_PROMPT, levels=(1, 2))
    for sample in outcome.samples:
        record = sample.record
        assert (record.stop_reason, record.length_cause) == ("length", "server_limit")
        assert (record.prompt_tokens or 0) + (record.output_tokens or 0) == MAX_MODEL_LEN
    verdict = outcome.verdict
    assert (verdict.kind, verdict.cause, verdict.onset_level) == ("baseline_truncation", "length:server_limit", 1)
    assert "188 output tokens though 300 were requested" in printed
