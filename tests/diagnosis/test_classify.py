"""The classification rules, one by one, and their precedence."""

from __future__ import annotations

from dataclasses import replace

import pytest

from proxy.diagnosis.classify import WireFacts, classify, is_oom, length_cause
from proxy.record import concurrency_bucket
from proxy.relay.in_flight import InFlightTracker
from proxy.wire.events import ErrorEvent, Finish

BASE = WireFacts(inference=True, status=200, finish=Finish("stop", "eos"), done=True)


def test_length_stop_below_requested_budget_is_server_limit() -> None:
    assert length_cause(10, 64, None) == "server_limit"


def test_length_stop_at_requested_budget_is_requested_budget() -> None:
    assert length_cause(64, 64, None) == "requested_budget"


def test_length_stop_with_no_budget_asked_is_server_limit() -> None:
    assert length_cause(500, None, None) == "server_limit"


def test_length_cause_unknown_without_a_token_count() -> None:
    assert length_cause(None, 64, None) == "unknown"


def test_a_lower_bound_below_the_budget_is_never_a_server_limit() -> None:
    assert length_cause(40, 64, None, exact=False) == "unknown"
    assert length_cause(64, 64, None, exact=False) == "requested_budget"
    assert length_cause(10, None, None, exact=False) == "server_limit"  # no budget: the server decided


def test_length_cause_divides_tokens_between_choices() -> None:
    assert length_cause(128, 64, 2) == "requested_budget"
    assert length_cause(100, 64, 2) == "server_limit"


@pytest.mark.parametrize("text", ["CUDA out of memory", "OOM while allocating", "cudaMalloc failed",
                                  "failed to allocate KV cache", "insufficient memory for model"])
def test_oom_texts(text: str) -> None:
    assert is_oom(text)


@pytest.mark.parametrize(("kind", "message", "expected"), [
    ("server_error", "Context size has been exceeded.", "context_exhausted"),  # llama.cpp, a shared pool
    ("exceed_context_size_error", "request (1163 tokens) exceeds the available context size (1024 tokens), "
     "try increasing it", "exceeds_context"),  # llama.cpp, a prompt over the slot
    ("exceed_context_size_error", "input (900 tokens) is larger than the max context size (512 tokens). "
     "skipping", "exceeds_context"),
    ("BadRequestError", "This model's maximum context length is 512 tokens. However, your prompt contains at "
     "least 513 input tokens", "exceeds_context"),  # vLLM
    ("BadRequestError", "max_tokens=600 cannot be greater than max_model_len=512. Please request fewer output "
     "tokens.", "exceeds_context"),  # vLLM
    (None, "the input length exceeds the context length", "exceeds_context"),  # Ollama
    ("api_error", "CUDA out of memory", "oom"),
    ("api_error", "something else", "error_event"),
])
def test_the_servers_words_for_a_context_that_ran_out(kind: str | None, message: str, expected: str) -> None:
    diagnosis = classify(replace(BASE, error=ErrorEvent(message, kind)))
    assert (diagnosis.stop_reason, diagnosis.upstream_error) == ("upstream_error", expected)
    diagnosis = classify(replace(BASE, status=400, error=ErrorEvent(message, kind)))
    assert diagnosis.upstream_error == ("http_status" if expected == "error_event" else expected)


def test_not_every_error_is_oom() -> None:
    assert not is_oom("room temperature") and not is_oom("bad request")


PRECEDENCE = [
    (dict(connect_error="connect", enforced="total", client_disconnected=True, status=None), "upstream_error"),
    (dict(enforced="total", client_disconnected=True), "deadline"),
    (dict(enforced="idle", client_disconnected=True), "idle_timeout"),
    (dict(client_disconnected=True, status=429, finish=None, done=False), "client_disconnect"),
    # gone after the answer's own end reached it: the end is the stop (client_disconnected stays true)
    (dict(client_disconnected=True), "eos"),
    (dict(client_disconnected=True, done=False), "eos"),  # closed on the finish, before [DONE]
    (dict(client_disconnected=True, done=False, n=2), "client_disconnect"),  # one choice of two ended
    (dict(client_disconnected=True, finish=None, done=True, streamed=True), "interrupted"),
    (dict(client_disconnected=True, finish=None, done=False), "client_disconnect"),
    # the server's error event came before the client left (the openai client raises on it and closes)
    (dict(client_disconnected=True, error=ErrorEvent("Context size has been exceeded.")), "upstream_error"),
    (dict(status=429), "rejected"),
    (dict(status=503), "rejected"),
    (dict(status=529), "rejected"),
    (dict(error=ErrorEvent("busy", "overloaded_error", overloaded=True)), "rejected"),
    (dict(status=500), "upstream_error"),
    (dict(inference=False, error=ErrorEvent("x")), "not_inference"),
    (dict(error=ErrorEvent("boom"), upstream_reset=True), "upstream_error"),
    (dict(upstream_reset=True, finish=None, done=False), "upstream_disconnect"),
    (dict(finish=None, done=False), "upstream_disconnect"),
    (dict(finish=None, done=True), "unknown"),  # a JSON body that says nothing
    (dict(finish=None, done=True, streamed=True), "interrupted"),  # [DONE] without a finish reason
    (dict(finish=None, done=True, streamed=True, parse_failed=True), "unknown"),
    (dict(finish=None, done=False, parse_failed=True), "unknown"),
]


@pytest.mark.parametrize(("overrides", "expected"), PRECEDENCE)
def test_precedence_of_causes(overrides: dict[str, object], expected: str) -> None:
    assert classify(replace(BASE, **overrides)).stop_reason == expected  # type: ignore[arg-type]


def test_upstream_error_kinds() -> None:
    assert classify(replace(BASE, status=500, error=ErrorEvent("CUDA out of memory"))).upstream_error == "oom"
    assert classify(replace(BASE, status=500)).upstream_error == "http_status"
    assert classify(replace(BASE, error=ErrorEvent("dead"))).upstream_error == "error_event"
    assert classify(replace(BASE, upstream_reset=True, finish=None)).upstream_error == "reset"
    assert classify(replace(BASE, finish=Finish("abort", "upstream_error", upstream_error="abort"))
                    ).upstream_error == "abort"


def test_a_context_limit_finish_is_a_server_limit_whatever_the_count() -> None:
    """Anthropic's model_context_window_exceeded: the server says the context ended it."""
    finish = Finish("model_context_window_exceeded", "length", context_limit=True)
    diagnosis = classify(replace(BASE, finish=finish, output_tokens=64, requested_max_tokens=64))
    assert (diagnosis.stop_reason, diagnosis.length_cause) == ("length", "server_limit")


@pytest.mark.parametrize(("value", "bucket"), [
    (0, "1"), (1, "1"), (2, "2"), (3, "4"), (4, "4"), (5, "8"), (9, "16"), (33, "64"), (64, "64"),
    (65, "128+"), (1000, "128+")])
def test_concurrency_buckets_are_the_next_power_of_two(value: int, bucket: str) -> None:
    assert concurrency_bucket(value) == bucket


def test_time_weighted_mean_concurrency() -> None:
    now = [0.0]
    tracker = InFlightTracker(clock=lambda: now[0])
    a = tracker.admit()
    now[0] = 1.0
    b = tracker.admit()  # a alone for 1 s, then both for 1 s
    now[0] = 2.0
    assert tracker.release(b) == (2, 2.0)
    assert tracker.release(a) == (2, 1.5)
    assert tracker.in_flight == 0


def test_peak_counts_requests_admitted_later() -> None:
    now = [0.0]
    tracker = InFlightTracker(clock=lambda: now[0])
    first = tracker.admit()
    others = [tracker.admit() for _ in range(4)]
    for slot in others:
        tracker.release(slot)
    now[0] = 1.0
    peak, _ = tracker.release(first)
    assert first.at_start == 1 and peak == 5


def test_plain_stop_with_stop_strings_requested_is_eos_but_not_certain() -> None:
    facts = replace(BASE, finish=Finish("stop", "eos", distinguishes_stop=False), stop_requested=True)
    verdict = classify(facts)
    assert verdict.stop_reason == "eos" and not verdict.certain


def test_vllm_null_stop_reason_proves_eos_even_with_stop_strings() -> None:
    verdict = classify(replace(BASE, finish=Finish("stop", "eos", distinguishes_stop=True), stop_requested=True))
    assert verdict.stop_reason == "eos" and verdict.certain


# --- a 200 stream that carried nothing ------------------------------------------------------------------
EMPTY = replace(BASE, streamed=True, has_prompt=True, delivered=0, output_tokens=None)


def test_a_stream_that_says_stop_without_one_piece_of_output_was_not_generated() -> None:
    """LM Studio over its context: 200, well-formed, zero content deltas, usage counting tokens all the
    same (lmstudio-ai/lmstudio-bug-tracker#2339)."""
    assert classify(EMPTY).stop_reason == "not_generated"
    assert classify(replace(EMPTY, output_tokens=12)).stop_reason == "not_generated"  # (its usage said 12)


@pytest.mark.parametrize("facts", [
    replace(EMPTY, delivered=1),  # one token, or a tool call's piece: an answer
    replace(EMPTY, streamed=False),  # a whole body: its own count decides
    replace(EMPTY, has_prompt=False),  # no generation was asked for
    replace(EMPTY, delivered=None),  # not counted
    replace(EMPTY, parse_failed=True),  # bytes the proxy could not read
])
def test_an_answer_or_what_the_proxy_cannot_tell_is_not_called_empty(facts: WireFacts) -> None:
    assert classify(facts).stop_reason == "eos"


def test_a_done_alone_stays_interrupted_the_wire_does_not_tell_why() -> None:
    assert classify(replace(EMPTY, finish=None, done=True)).stop_reason == "interrupted"


def test_an_error_body_sent_with_status_200_is_an_upstream_error() -> None:
    """LM Studio answers a prompt over its context with an error body and a 200
    (lmstudio-ai/lmstudio-bug-tracker#2322)."""
    error = ErrorEvent("Trying to keep the first 10136 tokens when context the overflows. However, the model is "
                       "loaded with context length of only 7866 tokens, which is not enough.")
    found = classify(replace(BASE, finish=None, error=error))
    assert found.stop_reason == "upstream_error" and found.upstream_error == "exceeds_context"
