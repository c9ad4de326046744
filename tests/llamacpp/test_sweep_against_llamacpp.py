"""`llm-diag-proxy sweep` through the proxy against real llama-servers: the verdict names the real cause.

The EOS model's answers take 41 tokens; the prompts and slot sizes are in conftest.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.llamacpp.conftest import EOS_PROMPT, UNIFIED_PROMPT
from tests.llamacpp.llama_server import LlamaServer
from tests.llamacpp.sweep_demo import sweep

pytestmark = pytest.mark.llamacpp

def samples_at(outcome: Any, level: int) -> list[Any]:
    return [s for s in outcome.samples if s.level == level]


async def test_sweep_finds_a_unified_pool_failing_from_concurrency_two(eos_unified_server: LlamaServer) -> None:
    outcome, printed = await sweep(eos_unified_server, UNIFIED_PROMPT, levels=(1, 2), repeats=2)
    assert [s.record.stop_reason for s in samples_at(outcome, 1)] == ["eos", "eos"]
    for sample in samples_at(outcome, 2):
        # HTTP 500 when it failed before its first token, else an error event mid-stream
        assert sample.record.stop_reason == "upstream_error"
        assert sample.record.upstream_error in ("error_event", "http_status")
        assert "Context size has been exceeded" in (sample.record.upstream_error_detail or "")
    assert all(s.record_source == "proxy" for s in outcome.samples)
    verdict = outcome.verdict
    assert (verdict.kind, verdict.cause, verdict.onset_level) == ("serving_defect", "upstream_error", 2)
    assert "Context size has been exceeded" in printed


async def test_sweep_on_slots_too_small_blames_the_server_limit_at_concurrency_one(
    eos_split_server: LlamaServer,
) -> None:
    outcome, _ = await sweep(eos_split_server, EOS_PROMPT, levels=(1, 2), repeats=2)
    for sample in outcome.samples:
        assert (sample.record.stop_reason, sample.record.length_cause) == ("length", "server_limit")
    verdict = outcome.verdict
    assert (verdict.kind, verdict.cause) == ("baseline_truncation", "length:server_limit")


async def test_sweep_on_one_big_slot_sees_answers_queue_but_complete_at_every_level(
    eos_single_server: LlamaServer,
) -> None:
    outcome, _ = await sweep(eos_single_server, EOS_PROMPT, levels=(1, 2), repeats=2)
    assert [s.record.stop_reason for s in outcome.samples] == ["eos"] * 6
    assert outcome.verdict.kind == "no_load_effect"
