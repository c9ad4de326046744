"""Each dialect module on its own: routes, request fields, the events in its objects, its finish table."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.diagnosis.recorder import read_request
from proxy.wire.dialects import REGISTRY, anthropic, dialect_named, ollama, openai, responses, route_of
from proxy.wire.dialects.base import as_int, as_number
from proxy.wire.events import (
    DONE,
    ONE_REASONING_TOKEN,
    ONE_TOKEN,
    ErrorEvent,
    Event,
    Finish,
    ServerTimings,
    TokenDelta,
    Usage,
)
from tests.support.wire import anthropic_message, anthropic_stream, responses_body, responses_stream


def data_of(event: bytes) -> Any:
    """The JSON of one SSE event built by tests.support.wire."""
    line = next(line for line in event.split(b"\n") if line.startswith(b"data: "))
    return orjson.loads(line[6:])


def all_events(dialect_events: Any, stream: list[bytes]) -> list[Event]:
    return [e for event in stream for e in dialect_events(data_of(event))]


def finishes(events: list[Event]) -> list[Finish]:
    return [e for e in events if isinstance(e, Finish)]


# --- the registry ------------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "route", "dialect"), [
    ("/v1/chat/completions", "/v1/chat/completions", "openai"),
    ("/v1/chat/completions/", "/v1/chat/completions", "openai"),
    ("/api/chat", "/api/chat", "ollama"),
    ("/completion", "/completion", "llamacpp"),
    ("/v1/messages", "/v1/messages", "anthropic"),
    ("/v1/responses", "/v1/responses", "responses"),
    ("/v1/messages/count_tokens", "other", None),
    ("/v1/models", "other", None),
])
def test_routes_find_their_dialect(path: str, route: str, dialect: str | None) -> None:
    found_route, found = route_of(path)
    assert (found_route, found.name if found else None) == (route, dialect)


def test_every_route_belongs_to_one_dialect() -> None:
    routes = [r for d in REGISTRY for r in d.routes]
    assert len(routes) == len(set(routes))
    assert {d.name for d in REGISTRY} == {"openai", "ollama", "llamacpp", "anthropic", "responses"}


# --- OpenAI chat/completions ---------------------------------------------------------------------

@pytest.mark.parametrize(("raw", "stop_reason", "expected"), [
    ("stop", None, "eos"), ("stop", "###", "stop_sequence"), ("stop", 128009, "stop_sequence"),
    ("length", None, "length"), ("tool_calls", None, "tool_calls"), ("function_call", None, "tool_calls"),
    ("content_filter", None, "content_filter"), ("repetition", None, "repetition"),
    ("abort", None, "upstream_error"), ("error", None, "upstream_error"), ("weird", None, "unknown"),
])
def test_openai_finish_table(raw: str, stop_reason: Any, expected: str) -> None:
    chunk = {"choices": [{"index": 0, "delta": {}, "finish_reason": raw, "stop_reason": stop_reason}]}
    (finish,) = finishes(openai.events(chunk))
    assert (finish.reason, finish.stop) == (raw, expected)


def test_openai_abort_and_error_are_engine_failures() -> None:
    kinds = [finishes(openai.events({"choices": [{"index": 0, "finish_reason": r}]}))[0].upstream_error
             for r in ("abort", "error", "stop")]
    assert kinds == ["abort", "error_event", None]


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_openai_reasoning_deltas_count_apart_from_the_answer(field: str) -> None:
    assert openai.events({"choices": [{"index": 0, "delta": {field: "hmm"}, "finish_reason": None}]}) == [
        ONE_REASONING_TOKEN]
    both = {"choices": [{"index": 0, "delta": {field: "so", "content": "A"}, "finish_reason": None}]}
    assert openai.events(both) == [ONE_REASONING_TOKEN, ONE_TOKEN]


def test_openai_tool_call_deltas_and_empty_content_are_told_apart() -> None:
    tool = {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]},
                         "finish_reason": None}]}
    assert openai.events(tool) == [ONE_TOKEN]
    assert openai.events({"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": None}]}) == []


def test_openai_usage_with_reasoning_details() -> None:
    usage = {"prompt_tokens": 5, "completion_tokens": 90,
             "completion_tokens_details": {"reasoning_tokens": 70}}
    assert openai.events({"choices": [], "usage": usage}) == [Usage(5, 90, 70)]


def test_llamacpp_timings_on_an_openai_chunk_give_the_token_count() -> None:
    chunk = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
             "timings": {"prompt_ms": 5.0, "predicted_ms": 40.0, "predicted_n": 8}}
    found = openai.events(chunk)
    assert Usage(None, 8) in found and ServerTimings(prompt_eval_s=0.005, eval_s=0.04) in found
    assert finishes(found)[0].distinguishes_stop is False  # llama.cpp has no stop_reason field


# --- Ollama ------------------------------------------------------------------------------------

def test_ollama_thinking_is_reasoning() -> None:
    assert ollama.events({"message": {"role": "assistant", "content": "", "thinking": "hm"}, "done": False}) == [
        ONE_REASONING_TOKEN]
    assert ollama.events({"response": "", "thinking": "hm", "done": False}) == [ONE_REASONING_TOKEN]
    assert ollama.events({"message": {"role": "assistant", "content": "", "tool_calls": [{}]}, "done": False}) == [
        ONE_TOKEN]


@pytest.mark.parametrize(("raw", "expected"), [("stop", "eos"), ("length", "length"), ("load", "not_inference"),
                                               ("unload", "not_inference"), ("odd", "unknown")])
def test_ollama_done_reasons(raw: str, expected: str) -> None:
    (finish,) = finishes(ollama.events({"done": True, "done_reason": raw, "eval_count": 1}))
    assert finish.stop == expected and not finish.distinguishes_stop


# --- Anthropic Messages ------------------------------------------------------------------------

@pytest.mark.parametrize(("raw", "sequence", "expected"), [
    ("end_turn", None, "eos"),
    ("end_turn", "###", "stop_sequence"),  # llama.cpp: end_turn, naming the stop word it matched
    ("stop_sequence", "###", "stop_sequence"),
    ("max_tokens", None, "length"),
    ("tool_use", None, "tool_calls"),
    ("pause_turn", None, "tool_calls"),
    ("refusal", None, "content_filter"),
    ("model_context_window_exceeded", None, "length"),
    ("something_new", None, "unknown"),
])
def test_anthropic_stop_reason_table(raw: str, sequence: str | None, expected: str) -> None:
    (finish,) = finishes(all_events(anthropic.events, anthropic_stream(1, raw, stop_sequence=sequence)))
    assert (finish.reason, finish.stop, finish.detail) == (raw, expected, sequence)
    assert finish.context_limit == (raw == "model_context_window_exceeded")


def test_anthropic_stream_events_in_order() -> None:
    found = all_events(anthropic.events, anthropic_stream(3, "max_tokens", thinking=2, input_tokens=12))
    assert found == [Usage(12, None), ONE_REASONING_TOKEN, ONE_REASONING_TOKEN, ONE_TOKEN, ONE_TOKEN, ONE_TOKEN,
                     Finish("max_tokens", "length"), Usage(None, 5), DONE]


def test_anthropic_tool_input_deltas_are_tokens() -> None:
    found = all_events(anthropic.events, anthropic_stream(4, "tool_use", tool=True))
    assert found.count(ONE_TOKEN) == 4 and finishes(found)[0].stop == "tool_calls"


def test_anthropic_cached_input_counts_as_prompt() -> None:
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 3, "cache_read_input_tokens": 100,
                                                             "output_tokens": 0}}}
    assert anthropic.events(start) == [Usage(103, None)]


def test_anthropic_errors_and_overload() -> None:
    overloaded = anthropic.events({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
    assert overloaded == [ErrorEvent("Overloaded", "overloaded_error", overloaded=True)]
    other = anthropic.events({"type": "error", "error": {"type": "api_error", "message": "boom"}})
    assert other == [ErrorEvent("boom", "api_error")]


def test_anthropic_non_streaming_message() -> None:
    found = anthropic.events(orjson.loads(anthropic_message(7, "stop_sequence", stop_sequence="END")))
    assert found == [Finish("stop_sequence", "stop_sequence", 0, "END"), Usage(12, 7)]


def test_anthropic_request_fields() -> None:
    info = read_request(anthropic.DIALECT, orjson.dumps({
        "model": "claude-ish", "max_tokens": 4096, "stop_sequences": ["###"], "temperature": 0.2,
        "thinking": {"type": "enabled", "budget_tokens": 3000}, "messages": []}))
    assert (info.model, info.requested_max_tokens, info.stop_requested, info.temperature, info.reasoning_budget,
            info.stream) == ("claude-ish", 4096, True, 0.2, 3000, False)


# --- OpenAI Responses --------------------------------------------------------------------------

@pytest.mark.parametrize(("status", "reason", "terminal", "expected"), [
    ("completed", None, None, "eos"),
    ("incomplete", "max_output_tokens", None, "length"),
    ("incomplete", "max_output_tokens", "response.completed", "length"),  # vLLM 0.32's way
    ("incomplete", "content_filter", None, "content_filter"),
    ("incomplete", "something_new", None, "unknown"),
])
def test_responses_terminal_status_decides(status: str, reason: str | None, terminal: str | None,
                                           expected: str) -> None:
    found = all_events(responses.events, responses_stream(2, status, reason=reason, terminal=terminal))
    (finish,) = finishes(found)
    assert finish.stop == expected
    assert Usage(9, 2, 0) in found


def test_responses_failed_is_an_error_event() -> None:
    found = all_events(responses.events, responses_stream(2, "failed"))
    assert ErrorEvent("the engine failed", "server_error") in found and not finishes(found)


def test_responses_reasoning_and_tool_deltas() -> None:
    found = all_events(responses.events, responses_stream(3, reasoning=4, tool=True))
    assert found.count(ONE_REASONING_TOKEN) == 4 and found.count(ONE_TOKEN) == 3
    assert finishes(found)[0].stop == "tool_calls"
    assert Usage(9, 7, 4) in found


def test_responses_completed_without_incomplete_details_proves_nothing() -> None:
    """llama.cpp's server says `completed` when max_output_tokens or the context runs out, too."""
    (finish,) = finishes(all_events(responses.events, responses_stream(2)))
    assert not finish.limit_blind
    (finish,) = finishes(all_events(responses.events, responses_stream(2, llamacpp=True)))
    assert finish.limit_blind


def test_responses_error_event_and_non_streaming_body() -> None:
    assert responses.events({"type": "error", "code": "rate_limit", "message": "slow down"}) == [
        ErrorEvent("slow down", "rate_limit")]
    found = responses.events(orjson.loads(responses_body(5, "incomplete", reason="max_output_tokens", reasoning=3)))
    assert finishes(found)[0].stop == "length" and Usage(9, 8, 3) in found


def test_responses_request_fields() -> None:
    info = read_request(responses.DIALECT, b'{"model":"m","input":"hi","max_output_tokens":32,"stream":true}')
    assert (info.model, info.requested_max_tokens, info.stream) == ("m", 32, True)


@pytest.mark.parametrize("name", ["openai", "ollama", "llamacpp", "anthropic", "responses"])
def test_no_dialect_raises_anything_but_value_errors_on_odd_shapes(name: str) -> None:
    events = dialect_named(name).events
    for odd in ({}, {"choices": "x"}, {"type": "content_block_delta", "delta": 3}, {"message": []},
                {"type": "response.completed", "response": []}, {"done": True, "done_reason": None}):
        events(odd)
    with pytest.raises(ValueError):
        events([1, 2])


@pytest.mark.parametrize("name", ["openai", "ollama", "llamacpp", "anthropic", "responses"])
def test_numbers_past_what_orjson_keeps_read_as_none_from_either_parser(name: str) -> None:
    """A body past orjson's size is read by the standard library's parser, which keeps integers of
    any size, `NaN` and `Infinity`: none of them may reach a record (no JSON, log line or database
    could take it; `float()` of a big integer raised and the proxy answered 500)."""
    huge = "9" * 40
    text = (f'{{"model": "m", "seed": {huge}, "max_tokens": {huge}, "max_completion_tokens": {huge}, '
            f'"temperature": Infinity, "n": {huge}, "truncate_prompt_tokens": -{huge}, "n_keep": {huge}, '
            f'"num_predict": {huge}, "max_output_tokens": {huge}, '
            f'"options": {{"num_ctx": {huge}, "seed": {huge}, "temperature": NaN, "num_predict": {huge}}}, '
            f'"messages": [{{"role": "user", "content": "{"a" * 300_000}"}}]}}')
    info = read_request(dialect_named(name), text.encode())
    assert info.body_parsed and info.body_note is None and info.model == "m"
    assert (info.seed, info.requested_max_tokens, info.temperature, info.n, info.num_ctx, info.truncate_prompt_tokens,
            info.n_keep) == (None,) * 7
    assert [as_int(n) for n in (2**63 - 1, 2**63, -(2**63), -(2**63) - 1)] == [2**63 - 1, None, -(2**63), None]
    assert [as_number(n) for n in (float("nan"), float("-inf"), 10**400, 3)] == [None, None, None, 3.0]
    usage = {"prompt_tokens": 5, "completion_tokens": 10**40, "input_tokens": 5, "output_tokens": 10**40,
             "prompt_eval_count": 5, "eval_count": 10**40, "tokens_evaluated": 5, "tokens_predicted": 10**40}
    counts = [event for obj in ({"usage": usage, "choices": []}, {"done": True, "stop": True, **usage},
                                {"type": "message_delta", "usage": usage},
                                {"type": "response.completed", "response": {"status": "completed", "usage": usage}})
              for event in dialect_named(name).events(obj) if isinstance(event, Usage)]
    assert counts and all((u.prompt_tokens, u.completion_tokens) == (5, None) for u in counts), counts


def test_token_deltas_are_shared_instances() -> None:
    assert TokenDelta(1) == ONE_TOKEN and TokenDelta(1, reasoning=True) == ONE_REASONING_TOKEN


# --- what a request says of its prompt --------------------------------------------------------------

def test_a_chats_user_and_tool_words_bound_its_prompt_from_below() -> None:
    body = {"model": "m", "messages": [
        {"role": "system", "content": "many system words that a template may fold away"},
        {"role": "user", "content": "three little words"},
        {"role": "assistant", "content": "assistant words are not counted"},
        {"role": "tool", "content": [{"type": "text", "text": "two parts"}, {"type": "image_url"}]},
        {"role": "user", "content": [{"type": "text", "text": "one"}]}]}
    info = read_request(dialect_named("openai"), orjson.dumps(body))
    assert (info.has_prompt, info.user_turn, info.prompt_words) == (True, True, 6)


def test_a_chat_of_system_messages_has_a_prompt_but_no_user_turn() -> None:
    info = read_request(dialect_named("ollama"), orjson.dumps(
        {"model": "m", "messages": [{"role": "system", "content": "be brief"}]}))
    assert (info.has_prompt, info.user_turn, info.prompt_words) == (True, False, 0)


def test_a_load_request_has_no_prompt() -> None:
    for body in ({"model": "m"}, {"model": "m", "messages": []}, {"model": "m", "prompt": ""}):
        info = read_request(dialect_named("ollama"), orjson.dumps(body))
        assert (info.has_prompt, info.user_turn) == (False, None)


def test_a_completion_prompt_is_counted_by_its_words_and_token_ids_are_not() -> None:
    info = read_request(dialect_named("openai"), orjson.dumps({"model": "m", "prompt": "a b  c\nd"}))
    assert (info.has_prompt, info.prompt_words, info.user_turn) == (True, 4, None)
    ids = read_request(dialect_named("openai"), orjson.dumps({"model": "m", "prompt": [1, 2, 3]}))
    assert (ids.has_prompt, ids.prompt_words) == (True, None)


def test_anthropic_tool_results_count_and_its_system_does_not() -> None:
    body = {"model": "m", "max_tokens": 5, "system": "lots of system words here", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi there"},
                                     {"type": "tool_result", "tool_use_id": "t", "content": "forty two"}]}]}
    info = read_request(dialect_named("anthropic"), orjson.dumps(body))
    assert (info.user_turn, info.prompt_words) == (True, 4)


def test_responses_input_as_text_or_items() -> None:
    text = read_request(dialect_named("responses"), orjson.dumps({"model": "m", "input": "one two three"}))
    assert (text.has_prompt, text.prompt_words) == (True, 3)
    items = read_request(dialect_named("responses"), orjson.dumps({"model": "m", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "four five"}]},
        {"type": "function_call_output", "call_id": "c", "output": "not a turn"}]}))
    assert (items.has_prompt, items.user_turn, items.prompt_words) == (True, True, 2)


def test_vllm_and_llamacpp_request_fields_that_shape_the_prompt() -> None:
    info = read_request(dialect_named("openai"), orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "truncate_prompt_tokens": 64,
         "stop_token_ids": [7, "x", 9]}))
    assert (info.truncate_prompt_tokens, info.stop_token_ids) == (64, (7, 9))
    native = read_request(dialect_named("llamacpp"), orjson.dumps({"prompt": "a b", "n_keep": -1}))
    assert (native.n_keep, native.prompt_words) == (-1, 2)


# --- 2026 server fields ---------------------------------------------------------------------------------

def test_sglang_matched_stop_names_a_stop_string_or_a_token() -> None:
    string = finishes(openai.events({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop",
                                                   "matched_stop": "###"}]}))[0]
    assert (string.stop, string.detail, string.distinguishes_stop) == ("stop_sequence", "###", True)
    token = finishes(openai.events({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop",
                                                  "matched_stop": 151645}]}))[0]
    assert (token.stop, token.matched_token, token.distinguishes_stop) == ("eos", 151645, True)
    nothing = finishes(openai.events({"choices": [{"index": 0, "delta": {}, "finish_reason": "length",
                                                    "matched_stop": None}]}))[0]
    assert (nothing.stop, nothing.matched_token) == ("length", None)


def test_llamacpp_timings_give_the_prompt_with_its_cached_tokens() -> None:
    chunk = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
             "timings": {"cache_n": 72, "prompt_n": 1, "predicted_n": 41}}
    assert Usage(73, 41) in openai.events(chunk)


def test_a_whole_openai_answer_shows_its_reasoning_and_its_answer() -> None:
    """Ollama's /v1 puts a whole answer's thinking in `message.reasoning` (openai/openai.go)."""
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "", "reasoning": "hm"},
                         "finish_reason": "length"}]}
    assert ONE_REASONING_TOKEN in openai.events(body) and ONE_TOKEN not in openai.events(body)


# --- what a request's messages bound: words (at least) and bytes (at most) ---------------------------
def test_every_messages_words_and_bytes_are_read_system_and_assistant_included() -> None:
    body = {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Where is Canberra?"},
                                       {"role": "assistant", "content": "In the ACT.", "thinking": "easy one"},
                                       {"role": "user", "content": [{"type": "text", "text": "Thanks é"}]}]}
    info = read_request(openai.DIALECT, orjson.dumps(body))
    assert (info.prompt_words, info.all_words, info.messages, info.tools) == (5, 12, 4, False)
    assert info.all_bytes == len("Be brief.Where is Canberra?In the ACT.easy oneThanks é".encode())


@pytest.mark.parametrize(("message", "words"), [
    ({"role": "user", "content": "look", "images": ["aGk="]}, 1),
    ({"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}]},
     1),
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}, 0),
])
def test_a_message_whose_tokens_are_not_its_text_leaves_the_bytes_unknown(message: dict[str, Any], words: int) -> None:
    info = read_request(ollama.DIALECT, orjson.dumps({"model": "m", "messages": [message]}))
    assert info.all_bytes is None and info.all_words == words


def test_tools_and_a_generate_system_prompt_are_read() -> None:
    info = read_request(openai.DIALECT, orjson.dumps({"model": "m", "tools": [{"type": "function"}],
                                                      "messages": [{"role": "user", "content": "hi"}]}))
    assert info.tools
    info = read_request(ollama.DIALECT, orjson.dumps({"model": "m", "prompt": "hi there", "system": "be kind"}))
    assert (info.all_words, info.all_bytes, info.messages) == (4, len("hi therebe kind"), 1)
