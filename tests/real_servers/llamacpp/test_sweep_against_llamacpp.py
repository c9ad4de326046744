"""`llm-diag-proxy sweep` through the proxy against real llama-servers: the verdict names the real cause.

The EOS model's answers take 41 tokens; the prompts and slot sizes are in conftest.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.real_servers.llamacpp.conftest import EOS_PROMPT, UNIFIED_PROMPT
from tests.real_servers.llamacpp.llama_server import LlamaServer
from tests.real_servers.llamacpp.sweep_demo import sweep

pytestmark = pytest.mark.llamacpp

def samples_at(outcome: Any, level: int) -> list[Any]:
    return [s for s in outcome.samples if s.level == level]


async def test_sweep_finds_a_unified_pool_failing_from_concurrency_two(eos_unified_server: LlamaServer) -> None:
    outcome, printed = await sweep(eos_unified_server, UNIFIED_PROMPT, levels=(1, 2), repeats=2)
    assert [s.record.stop_reason for s in samples_at(outcome, 1)] == ["eos", "eos"]
    for sample in samples_at(outcome, 2):
        # HTTP 500 when it failed before its first token, else an error event mid-stream
        assert sample.record.stop_reason == "upstream_error"
        assert sample.record.upstream_error == "context_exhausted"
        assert "Context size has been exceeded" in (sample.record.upstream_error_detail or "")
    assert all(s.record_source == "proxy" for s in outcome.samples)
    verdict = outcome.verdict
    assert (verdict.kind, verdict.cause, verdict.onset_level) == (
        "serving_defect", "upstream_error:context_exhausted", 2)
    assert "the KV cache / context ran out (a pool the requests share)" in verdict.headline
    assert "llama.cpp GET /props" in printed


async def test_sweep_on_slots_too_small_blames_the_server_limit_at_concurrency_one(
    eos_split_server: LlamaServer,
) -> None:
    outcome, _ = await sweep(eos_split_server, EOS_PROMPT, levels=(1, 2), repeats=2)
    for sample in outcome.samples:
        assert (sample.record.stop_reason, sample.record.length_cause) == ("length", "server_limit")
    verdict = outcome.verdict
    assert (verdict.kind, verdict.cause) == ("baseline_truncation", "length:server_limit")
    # one prompt, so only the server's own /props can say the sum is the context: it does
    assert verdict.headline.endswith("the context ends at 256 tokens per request (prompt + answer) "
                                     "(1,024 split over 4 slots = 256 each?)"), verdict.headline


async def test_sweep_on_one_big_slot_sees_answers_queue_but_complete_at_every_level(
    eos_single_server: LlamaServer,
) -> None:
    outcome, _ = await sweep(eos_single_server, EOS_PROMPT, levels=(1, 2), repeats=2)
    assert [s.record.stop_reason for s in outcome.samples] == ["eos"] * 6
    assert outcome.verdict.kind == "no_load_effect"


async def test_a_prompt_over_a_slot_is_named_at_concurrency_one_not_blamed_on_the_flags(
    eos_split_server: LlamaServer,
) -> None:
    outcome, printed = await sweep(eos_split_server, "x" * 300, levels=(1, 2), repeats=2)
    assert {(s.record.status, s.record.upstream_error) for s in outcome.samples} == {(400, "exceeds_context")}
    verdict = outcome.verdict
    assert (verdict.kind, verdict.cause, verdict.onset_level) == (
        "baseline_truncation", "upstream_error:exceeds_context", 1)
    assert "the request does not fit the context one request gets (256 tokens, 4 slots" in verdict.headline
    assert "exceeds the available context size" in printed
    assert "~" not in printed.split("VERDICT")[0]  # nothing was counted: no estimate marks
