"""Can the answer be used? Tool calls and JSON answers checked whole at their end, in every dialect,
from wires built after each server's own (each case names the report it follows); the text is kept
only for requests that asked for structure, bounded, and never reaches the record."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.diagnosis import stream_tally
from proxy.diagnosis.recorder import Recorder
from proxy.record import ResponseRecord
from proxy.sweep.stats import is_complete, stop_label
from tests.support.wire import DONE, chat_chunk, sse, usage_chunk

SSE = "text/event-stream"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
ARGUMENTS = '{"city": "Canberra", "unit": "celsius"}'


def chat(max_tokens: int = 16, **extra: Any) -> bytes:
    return orjson.dumps({"model": "m", "stream": True, "max_tokens": max_tokens,
                         "messages": [{"role": "user", "content": "weather?"}], **extra})


def recorded(path: str, body: bytes, chunks: list[bytes], content_type: str = SSE) -> ResponseRecord:
    recorder = Recorder.start("r1", "POST", path, started=0.0)
    recorder.request_body(body)
    recorder.response_head(200, content_type)
    for i, chunk in enumerate(chunks, start=1):
        recorder.chunk(chunk, i * 0.01)
    return recorder.finish(1.0)


def tool_chunk(arguments: str, *, index: int = 0, first: bool = False) -> bytes:
    """A vLLM chat chunk carrying a piece of a tool call's arguments (its id and name with the first)."""
    call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if first:
        call.update(id="call_1", type="function")
        call["function"]["name"] = "get_weather"
    chunk = chat_chunk()
    chunk["choices"][0]["delta"] = {"tool_calls": [call]}
    return sse(chunk)


def vllm_tool_stream(pieces: list[str], finish: str, completion_tokens: int) -> list[bytes]:
    return [sse(chat_chunk("", role=True)), *(tool_chunk(p, first=i == 0) for i, p in enumerate(pieces)),
            sse(chat_chunk(None, finish)), sse(usage_chunk(20, completion_tokens)), DONE]


def test_a_tool_call_cut_by_the_budget_that_vllm_calls_tool_calls_is_a_length_stop() -> None:
    """vllm-project/vllm#53269: finish_reason "tool_calls" at max_tokens, arguments half written."""
    record = recorded("/v1/chat/completions", chat(16, tools=TOOLS),
                      vllm_tool_stream(['{"city": "Can', 'berra", "un'], "tool_calls", 16))
    assert (record.stop_reason, record.length_cause, record.finish_reason_raw) == ("length", "requested_budget",
                                                                                   "tool_calls")
    assert (record.answer_complete, record.incomplete_part) == (False, "tool_call")
    assert "budget cut the answer" in (record.incomplete_detail or "") and record.outcome == "budget"
    assert not is_complete(record) and stop_label(record) == "length:requested_budget"


def test_a_broken_tool_call_below_the_budget_is_named_and_counted_as_not_whole() -> None:
    record = recorded("/v1/chat/completions", chat(200, tools=TOOLS),
                      vllm_tool_stream(['{"city": "Can'], "tool_calls", 9))
    assert (record.stop_reason, record.answer_complete, record.cause, record.outcome) == (
        "tool_calls", False, "answer_incomplete", "cut")
    assert "broken tool call" in (record.incomplete_detail or "")
    assert stop_label(record) == "answer_incomplete:tool_call"


def test_a_whole_tool_call_is_usable_and_its_text_is_kept_nowhere() -> None:
    record = recorded("/v1/chat/completions", chat(200, tools=TOOLS),
                      vllm_tool_stream([ARGUMENTS[:10], ARGUMENTS[10:]], "tool_calls", 12))
    assert (record.stop_reason, record.answer_complete, record.incomplete_detail) == ("tool_calls", True, None)
    assert b"Canberra" not in orjson.dumps(record.to_dict())


def test_json_that_ends_stop_while_still_open_is_not_whole() -> None:
    """A structured-output answer that ends "stop" inside its JSON (kekzl/imp#1199; vllm#12548)."""
    stream = [sse(chat_chunk("", role=True)), sse(chat_chunk('{"answer": "forty')), sse(chat_chunk(None, "stop")),
              sse(usage_chunk(10, 5)), DONE]
    record = recorded("/v1/chat/completions", chat(200, response_format={"type": "json_object"}), stream)
    assert (record.stop_reason, record.answer_complete, record.incomplete_part, record.cause) == (
        "eos", False, "json", "answer_incomplete")
    assert "not whole JSON" in (record.incomplete_detail or "") and "forty" not in (record.incomplete_detail or "")


def test_whole_json_is_usable() -> None:
    stream = [sse(chat_chunk("", role=True)), sse(chat_chunk('{"answer": ')), sse(chat_chunk("42}")),
              sse(chat_chunk(None, "stop")), DONE]
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    record = recorded("/v1/chat/completions", chat(200, response_format=schema), stream)
    assert (record.stop_reason, record.answer_complete) == ("eos", True)


def test_a_request_that_asked_for_no_structure_is_not_judged() -> None:
    stream = [sse(chat_chunk("", role=True)), sse(chat_chunk('{"open')), sse(chat_chunk(None, "stop")), DONE]
    record = recorded("/v1/chat/completions", chat(200), stream)
    assert (record.stop_reason, record.answer_complete, record.incomplete_detail) == ("eos", None, None)


def test_anthropic_input_json_deltas_cut_at_max_tokens() -> None:
    events = [
        {"type": "message_start", "message": {"usage": {"input_tokens": 20, "output_tokens": 1}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "tool_use", "id": "t", "name": "f",
                                                                      "input": {}}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta",
                                                              "partial_json": '{"city": "Can'}},
        {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 16}},
        {"type": "message_stop"}]
    body = orjson.dumps({"model": "m", "max_tokens": 16, "stream": True, "tools": [{"name": "f"}],
                         "messages": [{"role": "user", "content": "hi"}]})
    record = recorded("/v1/messages", body, [b"event: x\ndata: " + orjson.dumps(e) + b"\n\n" for e in events])
    assert (record.stop_reason, record.answer_complete, record.incomplete_part) == ("length", False, "tool_call")


def test_responses_function_call_arguments_and_ollama_whole_tool_calls() -> None:
    deltas = [{"type": "response.function_call_arguments.delta", "item_id": "fc_1", "output_index": 0,
               "delta": '{"city":'},
              {"type": "response.completed", "response": {
                  "object": "response", "status": "completed", "incomplete_details": None,
                  "output": [{"type": "function_call", "id": "fc_1", "arguments": '{"city":'}],
                  "usage": {"input_tokens": 5, "output_tokens": 4}}}]
    body = orjson.dumps({"model": "m", "input": "hi", "stream": True, "max_output_tokens": 100,
                         "tools": [{"type": "function", "name": "f"}]})
    record = recorded("/v1/responses", body, [sse(d) for d in deltas])
    assert (record.stop_reason, record.answer_complete) == ("tool_calls", False)
    line = {"model": "m", "created_at": "2026-12-05T00:00:00Z", "message": {"role": "assistant", "content": "",
            "tool_calls": [{"function": {"name": "f", "arguments": {"city": "Canberra"}}}]}, "done": False}
    last = {"model": "m", "created_at": "2026-12-05T00:00:01Z", "message": {"role": "assistant", "content": ""},
            "done": True, "done_reason": "stop", "prompt_eval_count": 5, "eval_count": 7}
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
    record = recorded("/api/chat", body, [orjson.dumps(line) + b"\n", orjson.dumps(last) + b"\n"],
                      "application/x-ndjson")
    assert (record.stop_reason, record.answer_complete) == ("eos", True)


def test_past_the_cap_the_check_is_not_made_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_tally, "TEXT_MAX_BYTES", 8)
    monkeypatch.setattr(stream_tally.AnswerTexts.__init__, "__defaults__", (8, lambda size: True, lambda size: None))
    record = recorded("/v1/chat/completions", chat(200, tools=TOOLS),
                      vllm_tool_stream([ARGUMENTS[:10], ARGUMENTS[10:]], "tool_calls", 12))
    assert record.answer_complete is None and "not checked" in (record.incomplete_detail or "")


# --- counts that cannot all be true ---------------------------------------------------------------------
def test_reasoning_above_the_output_is_a_usage_mismatch() -> None:
    """SGLang #39826: reasoning_tokens above completion_tokens."""
    usage = usage_chunk(10, 512)
    usage["usage"]["completion_tokens_details"] = {"reasoning_tokens": 900}
    stream = [sse(chat_chunk("", role=True)), sse(chat_chunk("hi")), sse(chat_chunk(None, "stop")), sse(usage), DONE]
    record = recorded("/v1/chat/completions", chat(1000), stream)
    assert record.usage_mismatch == "reasoning_tokens 900 exceed completion_tokens 512"


def test_output_counted_on_a_stream_that_delivered_none_is_a_usage_mismatch() -> None:
    """Usage counting tokens while no text arrives (lmstudio-bug-tracker#2339; speculative decoding
    that reports the whole budget, ik_llama.cpp#2358)."""
    stream = [sse(chat_chunk("", role=True)), sse(chat_chunk(None, "length")), sse(usage_chunk(10, 4096)), DONE]
    record = recorded("/v1/chat/completions", chat(4096), stream)
    assert record.usage_mismatch is not None and "4,096" in record.usage_mismatch


def test_pieces_that_carry_several_tokens_each_are_no_mismatch() -> None:
    """A piece is at least one token, so fewer pieces than counted tokens is what several tokens a
    chunk look like (speculative decoding that counts right), not a mismatch."""
    stream = [sse(chat_chunk("", role=True)), sse(chat_chunk("a b c d")), sse(chat_chunk(None, "stop")),
              sse(usage_chunk(10, 40)), DONE]
    assert recorded("/v1/chat/completions", chat(100), stream).usage_mismatch is None


def test_the_live_verdict_names_a_server_whose_counts_cannot_be_trusted() -> None:
    from proxy.sweep.live import count_lines

    good = ResponseRecord(request_id="a", method="POST", path="/v1/chat/completions", route="/v1/chat/completions",
                          dialect="openai", started_at=0.0, stop_reason="eos", upstream="http://a:8000")
    bad = ResponseRecord(request_id="b", method="POST", path="/v1/chat/completions", route="/v1/chat/completions",
                         dialect="openai", started_at=0.0, stop_reason="eos", upstream="http://b:8000",
                         usage_mismatch="reasoning_tokens 900 exceed completion_tokens 512")
    (line,) = count_lines([good, bad, good])
    assert line.startswith("http://b:8000: 1 of 1 answers") and "not to be trusted" in line
