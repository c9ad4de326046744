"""Same answer or not: the sweep hashes each seeded answer's text (never keeping it) and tells
answers that change under load, complete, from answers that are cut, and says when they are the
same text at every level."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from proxy.simulator import SCENARIOS, start_simulator
from proxy.sweep.answer_text import AnswerText
from proxy.sweep.session import execute
from proxy.sweep.stats import summarize
from proxy.sweep.sweep_command import plan_from_args
from proxy.sweep.verdict import decide
from tests.support.sweep_samples import level


def hashed(samples: list, texts: list[str]) -> list:  # type: ignore[type-arg]
    for sample, text in zip(samples, texts, strict=True):
        sample.client = replace(sample.client, answer_hash=text)
    return samples


def test_complete_answers_that_change_with_load_are_named_as_nondeterminism() -> None:
    groups = {1: hashed(level(1, 4), ["a"] * 4), 2: hashed(level(2, 6), ["a"] * 6),
              4: hashed(level(4, 8), ["a", "b", "c", "a", "d", "a", "e", "a"])}
    verdict = decide(summarize([s for g in groups.values() for s in g]), groups)
    assert (verdict.kind, verdict.cause, verdict.onset_level) == ("batch_nondeterminism", "batch_shape", 4)
    assert "50% of them are another text than at c=1" in verdict.headline and "not truncation" in verdict.headline
    assert "VLLM_BATCH_INVARIANT=1" in verdict.recommendation
    assert "--enable-deterministic-inference" in verdict.recommendation
    assert "c=1: 0/4, c=2: 0/6, c=4: 4/8" in " ".join(verdict.evidence)


def test_the_same_text_at_every_level_is_said_and_a_varying_baseline_is_not_blamed_on_load() -> None:
    groups = {1: hashed(level(1, 4), ["a"] * 4), 4: hashed(level(4, 8), ["a"] * 8)}
    same = decide(summarize([s for g in groups.values() for s in g]), groups)
    assert same.kind == "no_load_effect" and any("the same text at every level (12 answers" in line
                                                 for line in same.evidence)
    groups = {1: hashed(level(1, 4), ["a", "b", "a", "c"]), 4: hashed(level(4, 8), list("defghijk"))}
    varied = decide(summarize([s for g in groups.values() for s in g]), groups)
    assert varied.kind == "no_load_effect" and any("differ already at c=1" in line for line in varied.evidence)
    unhashed = {1: level(1, 4), 4: level(4, 8)}
    assert decide(summarize([s for g in unhashed.values() for s in g]), unhashed).kind == "no_load_effect"


@pytest.mark.parametrize(("dialect", "body"), [
    ("openai", b'data: {"choices":[{"delta":{"content":"Hel"}}]}\n\ndata: {"choices":[{"delta":{"content":"lo"}}]}\n\n'
               b"data: [DONE]\n\n"),
    ("anthropic", b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"type":"text_delta",'
                  b'"text":"Hel"}}\n\ndata: {"type":"content_block_delta","delta":{"type":"text_delta",'
                  b'"text":"lo"}}\n\n'),
    ("responses", b'data: {"type":"response.output_text.delta","delta":"Hel"}\n\n'
                  b'data: {"type":"response.output_text.delta","delta":"lo"}\n\n'),
    ("ollama", b'{"message":{"role":"assistant","content":"Hel"}}\n{"message":{"content":"lo"},"done":true}\n'),
])
def test_each_dialects_text_hashes_alike_however_it_was_cut_into_reads(dialect: str, body: bytes) -> None:
    whole, split = AnswerText(dialect), AnswerText(dialect)
    whole.feed(body)
    for n in range(0, len(body), 7):
        split.feed(body[n:n + 7])
    assert whole.digest() == split.digest()
    openai = AnswerText("openai")
    openai.feed(b'data: {"choices":[{"delta":{"content":"Hello"}}]}\n\n')
    assert whole.digest() == openai.digest() and whole.digest() is not None and len(whole.digest() or "") == 16


@pytest.mark.parametrize(("scenario", "kind"), [("nondeterministic", "batch_nondeterminism"),
                                                ("healthy", "no_load_effect")])
async def test_a_server_whose_answers_change_with_the_batch_is_named_against_the_simulator(
        scenario: str, kind: str) -> None:
    simulator = await start_simulator(SCENARIOS[scenario])
    try:
        args = type("Args", (), {"levels": (1, 4), "repeats": 3, "prompt": "Explain gears.", "max_tokens": 256,
                                 "seed": 1, "temperature": 0.0, "timeout": 30.0, "warmup": 1})()
        plan = plan_from_args(args, simulator.url, None, SCENARIOS[scenario].model)
        with open(os.devnull, "w") as quiet:
            outcome = await execute(plan, out_dir=None, report_path=None, progress=False, stdout=quiet)
    finally:
        await simulator.close()
    assert outcome.verdict.kind == kind, outcome.verdict.text()
    assert all(s.record.stop_reason == "eos" for s in outcome.samples)  # complete at every level
    if kind == "no_load_effect":
        assert any("the same text at every level" in line for line in outcome.verdict.evidence)
