"""The framing and dialect parsers, over arbitrary chunk boundaries."""

from __future__ import annotations

import tracemalloc

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.diagnosis.recorder import read_request
from proxy.wire.dialects import dialect_named, llamacpp, ollama, openai
from proxy.wire.events import DONE, ErrorEvent, Event, Finish, ParseError, ServerTimings, TokenDelta, Usage
from proxy.wire.lines import LineSplitter
from proxy.wire.parsers import ORJSON_MAX_BYTES, load_json, parser_for
from proxy.wire.sse import SseDecoder
from tests.support.chunking import split_at
from tests.support.wire import ollama_stream, openai_completion, openai_stream, sse


def feed_all(parser_kind: tuple[str, str], chunks: list[bytes], *, fast_path: bool = False) -> list[Event]:
    """Every event, one per event on the wire (fast_path=False), or as the fast path gives them
    (plain tokens of one read counted into one TokenDelta)."""
    parser = parser_for(dialect_named(parser_kind[0]), parser_kind[1], "", max_line=1 << 20, body_cap=1 << 20,
                        fast_path=fast_path)
    events: list[Event] = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    events.extend(parser.close())
    return events


def folded(events: list[Event]) -> tuple[list[Event], int, int]:
    """The events other than tokens, in order, and the visible and reasoning token totals: what a
    tally makes of them, whatever the reads were."""
    tokens = [e for e in events if isinstance(e, TokenDelta)]
    return ([e for e in events if not isinstance(e, TokenDelta)],
            sum(t.count for t in tokens if not t.reasoning), sum(t.count for t in tokens if t.reasoning))


def test_line_splitter_handles_lf_crlf_and_lone_cr() -> None:
    lines = LineSplitter(100)
    assert lines.feed(b"a\nb\r\nc\rd") == [b"a", b"b", b"c"]
    assert lines.close() == [b"d"]


def test_crlf_split_across_chunks_is_one_line_end() -> None:
    lines = LineSplitter(100)
    assert lines.feed(b"a\r") == [b"a"]
    assert lines.feed(b"\nb\n") == [b"b"]


def test_overlong_line_is_dropped_and_counted_with_bounded_memory() -> None:
    lines = LineSplitter(10)
    for _ in range(1000):
        assert lines.feed(b"x" * 1000) == []
    assert lines.feed(b"tail\nok\n") == [b"ok"]
    assert lines.overlong == 1


def test_sse_multiline_data_comments_and_event_names() -> None:
    decoder = SseDecoder(1000)
    events = decoder.feed(b": comment\nevent: error\ndata: a\ndata:b\n\ndata\n\n")
    assert events == [(b"error", b"a\nb"), (None, b"")]


def test_sse_event_still_open_at_end_is_discarded() -> None:
    decoder = SseDecoder(1000)
    assert decoder.feed(b"data: x") == []
    assert decoder.close() == []


def test_openai_chunk_events() -> None:
    chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "length", "stop_reason": None}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 9}}
    assert openai.events(chunk) == [TokenDelta(1), Finish("length", "length", 0, None), Usage(3, 9)]


def test_openai_legacy_completion_text_counts_as_token() -> None:
    assert openai.events({"choices": [{"index": 0, "text": "x", "finish_reason": None}]}) == [TokenDelta(1)]


def test_vllm_error_object_of_either_generation() -> None:
    assert openai.events({"error": {"message": "boom", "type": "BadRequestError"}}) == [
        ErrorEvent("boom", "BadRequestError")]
    assert openai.events({"object": "error", "message": "boom", "type": "x", "code": 400}) == [ErrorEvent("boom", "x")]


def test_llamacpp_native_final_object() -> None:
    obj = {"content": "", "stop": True, "stop_type": "limit", "stopping_word": "", "truncated": True,
           "tokens_predicted": 12, "tokens_evaluated": 40, "timings": {"prompt_ms": 10.0, "predicted_ms": 200.0}}
    events = llamacpp.events(obj)
    assert Finish("limit", "length", 0, None, True) in events
    assert Usage(40, 12) in events
    assert ServerTimings(prompt_eval_s=0.01, eval_s=0.2) in events


def test_ollama_done_line_events() -> None:
    final = orjson.loads(ollama_stream(0, "length")[-1])
    events = ollama.events(final)
    assert events[:2] == [Finish("length", "length", distinguishes_stop=False), Usage(26, 0)]
    assert isinstance(events[2], ServerTimings) and events[2].total_s == 1.5


def test_ollama_error_line() -> None:
    assert ollama.events({"error": "model requires more system memory"}) == [
        ErrorEvent("model requires more system memory")]


def test_request_budget_fields_of_each_dialect() -> None:
    chat = read_request(openai.DIALECT, b'{"model":"m","max_completion_tokens":5,"max_tokens":9,"seed":1,"n":2}')
    assert (chat.requested_max_tokens, chat.seed, chat.n, chat.stream) == (5, 1, 2, False)
    native = read_request(ollama.DIALECT, b'{"model":"m","options":{"num_predict":-1,"num_ctx":4096}}')
    assert native.requested_max_tokens is None and native.num_ctx == 4096 and native.stream is True
    llama = read_request(llamacpp.DIALECT, b'{"prompt":"x","n_predict":16}')
    assert llama.requested_max_tokens == 16


def test_request_body_that_is_not_json_is_noted() -> None:
    info = read_request(openai.DIALECT, b"\x00garbage")
    assert not info.body_parsed and info.body_note == "request body is not JSON"


def test_non_streaming_json_body() -> None:
    events = feed_all(("openai", "application/json"), [openai_completion(5, "length")])
    assert Finish("length", "length", 0, None) in events and Usage(7, 5) in events and events[-1] == DONE


def test_json_body_over_cap_is_a_parse_error() -> None:
    parser = parser_for(openai.DIALECT, "application/json", "", max_line=10, body_cap=10)
    parser.feed(b"x" * 11)
    assert isinstance(parser.close()[0], ParseError)


def test_unsupported_encoding_and_unknown_media_are_parse_errors() -> None:
    assert isinstance(feed_all(("openai", "text/html"), [b"<html>"])[0], ParseError)
    parser = parser_for(openai.DIALECT, "text/event-stream", "br", max_line=10, body_cap=10)
    assert isinstance(parser.close()[0], ParseError)


STREAMS = [
    (("openai", "text/event-stream"), b"".join(openai_stream(20, "length"))),
    (("openai", "text/event-stream"), b"".join(openai_stream(5, stop_reason=7)).replace(b"\n", b"\r\n")),
    (("ollama", "application/x-ndjson"), b"".join(ollama_stream(15))),
    (("openai", "text/event-stream"), sse({"choices": [{"index": 0, "delta": {"content": "é漢🙂"},
                                                        "finish_reason": "stop"}]}) + b"data: [DONE]\n\n"),
]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(STREAMS), st.lists(st.integers(min_value=0, max_value=10_000), max_size=30))
def test_events_do_not_depend_on_chunk_boundaries(stream: tuple[tuple[str, str], bytes], cuts: list[int]) -> None:
    kind, data = stream
    whole = feed_all(kind, [data])
    assert feed_all(kind, split_at(data, cuts)) == whole
    for chunks in (split_at(data, cuts), [data]):  # the fast path folds tokens, and agrees on the rest
        assert folded(feed_all(kind, chunks, fast_path=True)) == folded(whole)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2000), st.lists(st.integers(min_value=0, max_value=2000), max_size=10),
       st.sampled_from(["text/event-stream", "application/x-ndjson", "application/json"]))
def test_parsers_never_raise_on_arbitrary_bytes(data: bytes, cuts: list[int], media: str) -> None:
    for dialect in ("openai", "ollama", "llamacpp", "anthropic", "responses"):
        feed_all((dialect, media), split_at(data, cuts))


# --- big documents: bounded memory, same reading ----------------------------------------------------

def test_a_big_request_is_read_with_memory_bounded_by_twice_its_size() -> None:
    """orjson sets aside about 13 times its input before parsing; a 12 MiB request read that way
    would take some 150 MiB for a moment. Big documents go to the standard library's parser."""
    body = bytearray(orjson.dumps({"model": "m", "max_tokens": 9, "stop": ["\n"], "seed": 4,
                                   "messages": [{"role": "user", "content": "é" * (6 << 20)}]}))
    tracemalloc.start()
    try:
        info = read_request(openai.DIALECT, body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (info.model, info.requested_max_tokens, info.stop_requested, info.seed) == ("m", 9, True, 4)
    assert peak < 2.5 * len(body)


@given(st.recursive(st.none() | st.booleans() | st.integers(-2**60, 2**60) | st.text(max_size=30),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=30))
@settings(max_examples=100)
def test_big_and_small_documents_are_read_alike(value: object) -> None:
    document = orjson.dumps({"padding": "p" * (ORJSON_MAX_BYTES + 1), "value": value})
    assert load_json(document)["value"] == orjson.loads(document)["value"]


def test_a_big_document_nested_too_deep_is_unreadable_not_an_exception() -> None:
    deep = b'{"padding": "' + b"p" * ORJSON_MAX_BYTES + b'", "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    with pytest.raises(ValueError, match="nested too deeply"):
        load_json(deep)
    info = read_request(openai.DIALECT, deep)
    assert info.body_note == "request body is not JSON" and not info.body_parsed
