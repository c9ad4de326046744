"""The Recorder on its own: bytes and endings in, one classified record out; no network, no clock."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from proxy.diagnosis.recorder import Recorder
from proxy.record import ResponseRecord
from tests.support.wire import (
    anthropic_stream,
    chat_chunk,
    ollama_line,
    ollama_stream,
    openai_completion,
    openai_stream,
    responses_stream,
    sse,
)

SSE = "text/event-stream; charset=utf-8"
CHAT_BODY = orjson.dumps({"model": "m", "messages": [], "stream": True, "max_tokens": 64})


def recorded(path: str, body: bytes | None, chunks: list[bytes], content_type: str = SSE, status: int = 200,
             step: float = 0.01) -> ResponseRecord:
    """Feed one whole exchange, chunk i arriving at i * step seconds after the start."""
    recorder = Recorder.start("r1", "POST", path, started=0.0)
    recorder.request_body(body)
    recorder.response_head(status, content_type)
    for i, chunk in enumerate(chunks, start=1):
        recorder.chunk(chunk, i * step)
    return recorder.finish((len(chunks) + 1) * step)


def test_a_stream_becomes_a_classified_record() -> None:
    record = recorded("/v1/chat/completions", CHAT_BODY, openai_stream(10, "length", usage=True))
    assert (record.dialect, record.route, record.model, record.stream, record.requested_max_tokens) == (
        "openai", "/v1/chat/completions", "m", True, 64)
    assert (record.stop_reason, record.length_cause, record.output_tokens, record.tokens_source) == (
        "length", "server_limit", 10, "usage")
    assert record.ttft_s == pytest.approx(0.02)  # the role chunk carries no token
    assert record.itl_mean_s == pytest.approx(0.01) and record.duration_s == pytest.approx(0.15)
    assert record.bytes_out == sum(len(c) for c in openai_stream(10, "length", usage=True))


def test_a_non_streaming_answer_has_no_time_to_first_token() -> None:
    record = recorded("/v1/chat/completions", CHAT_BODY.replace(b"true", b"false"), [openai_completion(5)],
                      content_type="application/json")
    assert (record.stop_reason, record.output_tokens) == ("eos", 5)
    assert record.ttft_s is None and record.itl_mean_s is None


def test_a_reasoning_heavy_budget_stop_without_usage_is_the_requested_budget() -> None:
    """vLLM sends thinking in `delta.reasoning`: counted, it is part of the budget spent."""
    chunks = [sse(chat_chunk("", role=True))]
    for i in range(60):
        chunk = chat_chunk()
        chunk["choices"][0]["delta"] = {"reasoning": f"hm{i} "}
        chunks.append(sse(chunk))
    chunks += [sse(chat_chunk(f"a{i}")) for i in range(3)]
    chunks += [sse(chat_chunk("b", "length")), b"data: [DONE]\n\n"]
    record = recorded("/v1/chat/completions", CHAT_BODY, chunks)
    assert (record.output_tokens, record.tokens_source, record.reasoning_tokens, record.visible_tokens) == (
        64, "counted", 60, 4)
    assert (record.stop_reason, record.length_cause) == ("length", "requested_budget")
    assert record.reasoning_share == pytest.approx(60 / 64) and record.budget_mostly_reasoning


def test_the_servers_reasoning_count_wins_over_the_counted_one() -> None:
    chunks = anthropic_stream(5, "max_tokens", thinking=3)
    body = orjson.dumps({"model": "m", "max_tokens": 8, "stream": True, "messages": []})
    record = recorded("/v1/messages", body, chunks)
    assert (record.output_tokens, record.tokens_source, record.reasoning_tokens, record.length_cause) == (
        8, "usage", 3, "requested_budget")  # Anthropic gives no reasoning count: the thinking deltas
    chunks = responses_stream(2, "incomplete", reason="max_output_tokens", reasoning=30)
    body = orjson.dumps({"model": "m", "input": "x", "max_output_tokens": 32, "stream": True})
    record = recorded("/v1/responses", body, chunks)
    assert (record.output_tokens, record.reasoning_tokens, record.visible_tokens) == (32, 30, 2)
    assert record.budget_mostly_reasoning


def test_ollama_queue_time_carries_no_floating_point_noise() -> None:
    final = orjson.loads(ollama_stream(0)[-1])
    # 0.3 + 0.1 + 0.2 is 0.6000000000000001 in floating point: total minus the parts is -1e-16, not 0
    final.update(total_duration=600_000_000, load_duration=300_000_000, prompt_eval_duration=100_000_000,
                 eval_duration=200_000_000)
    record = recorded("/api/chat", b'{"model":"m"}', [ollama_line(final)], content_type="application/x-ndjson")
    assert record.queue_time_s == 0.0 and record.queue_time_source == "server_durations"


def test_a_refused_connection_is_an_upstream_error_with_the_proxys_status() -> None:
    recorder = Recorder.start("r1", "POST", "/v1/chat/completions", started=0.0)
    recorder.request_body(CHAT_BODY)
    recorder.no_answer("connect", "cannot connect to http://127.0.0.1:9", 502)
    record = recorder.finish(0.5)
    assert (record.status, record.stop_reason, record.upstream_error) == (502, "upstream_error", "connect")
    assert record.output_tokens is None and record.duration_s == 0.5


def test_a_body_cut_midway_is_an_upstream_disconnect_with_what_arrived() -> None:
    recorder = Recorder.start("r1", "POST", "/v1/chat/completions", started=0.0)
    recorder.request_body(CHAT_BODY)
    recorder.response_head(200, SSE)
    for i, chunk in enumerate(openai_stream(5)[:4]):
        recorder.chunk(chunk, 0.1 * i)
    recorder.upstream_broke("reset")
    record = recorder.finish(1.0)
    assert (record.stop_reason, record.upstream_error, record.output_tokens) == ("upstream_disconnect", "reset", 3)


def test_a_client_gone_mid_stream_and_enforced_and_observed_deadlines() -> None:
    recorder = Recorder.start("r1", "POST", "/api/chat", started=0.0)
    recorder.request_body(b'{"model":"m"}')
    recorder.response_head(200, "application/x-ndjson")
    recorder.chunk(ollama_stream(3)[0], 0.1)
    recorder.client_left()
    record = recorder.finish(0.2)
    assert (record.stop_reason, record.client_disconnected, record.disconnect_phase) == (
        "client_disconnect", True, "mid_stream")
    recorder = Recorder.start("r2", "POST", "/api/chat", started=0.0)
    recorder.deadline_enforced("idle", status=504)
    record = recorder.finish(5.0)
    assert (record.stop_reason, record.status, record.deadline_hit, record.deadline_mode) == (
        "idle_timeout", 504, "idle", "enforce")
    recorder = Recorder.start("r3", "POST", "/api/chat", started=0.0)
    recorder.response_head(200, "application/x-ndjson")
    for chunk in ollama_stream(2):
        recorder.chunk(chunk, 0.1)
    recorder.deadline_observed("total")
    record = recorder.finish(9.0)
    assert (record.stop_reason, record.deadline_hit, record.deadline_mode) == ("eos", "total", "observe")


def test_a_route_that_is_no_generation_still_reads_its_error_body() -> None:
    record = recorded("/v1/models", None, [b'{"error": {"message": "nope", "type": "x"}}'],
                      content_type="application/json", status=500)
    assert (record.route, record.dialect, record.stop_reason) == ("other", "none", "upstream_error")
    assert record.upstream_error_detail == "HTTP 500: nope"
    record = recorded("/v1/models", None, [b'{"data": []}'], content_type="application/json")
    assert record.stop_reason == "not_inference" and not record.parse_error


def test_a_request_body_too_large_to_read_is_noted_and_the_record_still_made() -> None:
    recorder = Recorder.start("r1", "POST", "/v1/chat/completions", started=0.0)
    recorder.request_body(None, "request body over the 10-byte parse cap: not parsed")
    recorder.response_head(200, SSE)
    for chunk in openai_stream(2):
        recorder.chunk(chunk, 0.1)
    record = recorder.finish(0.2)
    assert record.model is None and record.stop_reason == "eos"


def test_concurrency_is_what_the_caller_says() -> None:
    recorder = Recorder.start("r1", "POST", "/v1/chat/completions", started=0.0)
    recorder.concurrency(3, 7, 4.5)
    record = recorder.finish(1.0)
    assert (record.concurrency_at_start, record.concurrency_peak, record.concurrency_mean) == (3, 7, 4.5)


def test_thinking_and_nothing_else_spends_the_whole_output() -> None:
    """Ollama thinks by default: num_predict spent in `thinking`, `content` empty, its count exact."""
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "why?"}],
                         "options": {"num_predict": 16}})
    lines = [ollama_line({"message": {"role": "assistant", "content": "", "thinking": f"hm{i} "}, "done": False})
             for i in range(16)]
    lines.append(ollama_line({"message": {"role": "assistant", "content": ""}, "done": True, "done_reason": "length",
                              "prompt_eval_count": 12, "eval_count": 16}))
    record = recorded("/api/chat", body, lines, content_type="application/x-ndjson")
    assert (record.output_tokens, record.reasoning_tokens, record.visible_tokens) == (16, 16, 0)
    assert (record.length_cause, record.length_cause_source, record.reasoning_share) == (
        "requested_budget", "output_count", 1.0)
    assert record.budget_mostly_reasoning


def test_a_load_answer_to_a_chat_without_a_user_turn_is_not_generated() -> None:
    body = orjson.dumps({"model": "m", "messages": [{"role": "system", "content": "be brief"}], "stream": False})
    final = ollama_line({"message": {"role": "assistant", "content": ""}, "done": True, "done_reason": "load"})
    record = recorded("/api/chat", body, [final], content_type="application/json")
    assert (record.stop_reason, record.cause, record.outcome, record.user_turn) == (
        "not_generated", "no_user_turn", "client_error", False)
    assert record.stop_detail == "the server generated nothing (done_reason 'load'): the chat has no user turn"


def test_a_load_answer_to_a_generate_with_a_prompt_is_not_generated_and_says_it_loaded() -> None:
    body = orjson.dumps({"model": "m", "prompt": "hello there", "stream": False})
    final = ollama_line({"response": "", "done": True, "done_reason": "load"})
    record = recorded("/api/generate", body, [final], content_type="application/json")
    assert (record.stop_reason, record.cause, record.outcome) == ("not_generated", "not_generated", "cut")
    assert record.stop_detail is not None and "model load" in record.stop_detail


def test_a_stop_token_the_client_asked_for_is_a_stop_sequence_when_sglang_names_it() -> None:
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop_token_ids": [42]})
    chunk = chat_chunk(None, "stop")
    del chunk["choices"][0]["stop_reason"]
    chunk["choices"][0]["matched_stop"] = 42
    record = recorded("/v1/chat/completions", body, [sse(chat_chunk("a")), sse(chunk), b"data: [DONE]\n\n"])
    assert (record.stop_reason, record.stop_reason_certain) == ("stop_sequence", True)
    chunk["choices"][0]["matched_stop"] = 151645  # EOS
    record = recorded("/v1/chat/completions", body, [sse(chat_chunk("a")), sse(chunk), b"data: [DONE]\n\n"])
    assert (record.stop_reason, record.stop_reason_certain) == ("eos", True)


def test_a_length_stop_whose_tokens_were_counted_asks_the_servers_tokenizer() -> None:
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64,
                         "stream": True})
    recorder = Recorder.start("r1", "POST", "/v1/chat/completions", started=0.0)
    recorder.request_body(bytearray(body))
    recorder.response_head(200, SSE)
    for chunk in openai_stream(40, "length", usage=False):
        recorder.chunk(chunk, 0.01)
    record = recorder.finish(1.0)
    assert (record.length_cause, record.length_cause_source) == ("unknown", "counted")
    query = recorder.tokenizer_query()
    assert query is not None and (query.route, query.model, query.requested_max_tokens) == (
        "/v1/chat/completions", "m", 64)
    assert query.body == body
    with_usage = Recorder.start("r2", "POST", "/v1/chat/completions", started=0.0)
    with_usage.request_body(body)
    with_usage.response_head(200, SSE)
    for chunk in openai_stream(40, "length", usage=True):
        with_usage.chunk(chunk, 0.01)
    assert with_usage.finish(1.0).length_cause == "server_limit" and with_usage.tokenizer_query() is None


@pytest.mark.parametrize("usage", [True, False])
def test_a_length_stop_whose_request_was_not_read_is_no_server_limit(usage: bool) -> None:
    """A budget the proxy could not read is not a budget the client did not ask for."""
    recorder = Recorder.start("r1", "POST", "/v1/chat/completions", started=0.0)
    recorder.request_body(None, "request body over the 10-byte parse cap: not parsed")
    recorder.response_head(200, SSE)
    for chunk in openai_stream(40, "length", usage=usage):
        recorder.chunk(chunk, 0.01)
    record = recorder.finish(1.0)
    assert (record.length_cause, record.length_cause_source) == ("unknown", "request_unread")
    assert record.length_cause_detail == "not decided: the request was not read (request body over the 10-byte " \
                                        "parse cap: not parsed)"
    assert recorder.tokenizer_query() is None


def test_a_streams_reads_wait_to_be_parsed_in_bounded_runs() -> None:
    """Reads are parsed RUN_READS at a time (or RUN_BYTES), never more held, and all by the end."""
    from proxy.diagnosis.stream_tally import RUN_BYTES, RUN_READS

    recorder = Recorder.start("r", "POST", "/v1/chat/completions", started=0.0)
    recorder.request_body(b'{"model":"m","stream":true}')
    recorder.response_head(200, "text/event-stream")
    tally = recorder.tally
    event = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
             b'"delta":{"content":"t"},"logprobs":null,"finish_reason":null}]}\n\n')
    for n in range(RUN_READS * 3 + 5):
        recorder.chunk(event, 0.01 * n)
        assert len(tally.pending) < RUN_READS and tally.pending_bytes < RUN_BYTES
    recorder.chunk(b": " + b"p" * RUN_BYTES + b"\n\n", 1.0)  # a run's bytes end it at once
    assert not tally.pending
    record = recorder.finish(2.0)
    assert record.output_tokens == RUN_READS * 3 + 5 and not tally.pending


@pytest.mark.parametrize("chunks", [
    openai_stream(50, "length", usage=True),
    ollama_stream(40, "stop"),
    anthropic_stream(35, "max_tokens"),
], ids=["openai", "ollama", "anthropic"])
def test_a_record_made_in_steps_is_the_record_made_at_once(chunks: list[bytes]) -> None:
    """The relay's finish goes in steps (the reads left parsed STEP_READS at a time, then the record
    filled), the loop's other work between them: the record is the one `finish` makes in one go,
    and each step holds at most STEP_READS reads' parsing."""
    from proxy.diagnosis.stream_tally import STEP_READS

    path = {"openai": "/v1/chat/completions", "ollama": "/api/chat", "anthropic": "/v1/messages"}
    kind = "ollama" if chunks[0].startswith(b"{") else "anthropic" if b"message_start" in chunks[0] else "openai"
    media = "application/x-ndjson" if kind == "ollama" else SSE
    recorders = []
    for _ in range(2):
        recorder = Recorder.start("r1", "POST", path[kind], started=0.0)
        recorder.request_body(CHAT_BODY)
        recorder.response_head(200, media)
        for i, chunk in enumerate(chunks, start=1):
            recorder.chunk(chunk, i * 0.01)
        recorders.append(recorder)
    at_once = recorders[0].finish(1.0)
    stepped, pending_seen = recorders[1], []
    for _ in stepped.finish_steps(1.0):
        pending_seen.append(len(stepped.tally.pending))
    assert len(pending_seen) == (len(chunks) - 1) // STEP_READS >= 2
    assert all(left == len(chunks) - STEP_READS * n for n, left in enumerate(pending_seen, start=1))
    assert dataclasses.replace(stepped.record, started_at=at_once.started_at) == at_once  # (the wall clock's)
    assert at_once.output_tokens and at_once.stop_reason != "unknown"


@pytest.mark.parametrize(("chunks", "media", "run"), [
    (openai_stream(50, "length", usage=True), SSE, 16),
    (openai_stream(50, "length", usage=True), SSE, 5),
    (openai_stream(50, "length", usage=True), "application/json", 16),  # (not a stream: parsed as it comes)
], ids=["openai-runs-of-16", "openai-runs-of-5", "not-a-stream"])
def test_reads_handed_over_in_their_framing_make_the_record_each_payload_makes(chunks: list[bytes], media: str,
                                                                               run: int) -> None:
    """The relay's lane hands its reads over in runs, each payload left inside its chunk's framing
    (`reads_sink`): the record is the one the payloads fed one by one make, bytes_out included."""
    framed = [(b"%x\r\n%b\r\n" % (len(chunk), chunk), 0.01 * n) for n, chunk in enumerate(chunks, start=1)]
    one_by_one = Recorder.start("r1", "POST", "/v1/chat/completions", started=0.0)
    in_runs = Recorder.start("r1", "POST", "/v1/chat/completions", started=0.0)
    for recorder in (one_by_one, in_runs):
        recorder.request_body(CHAT_BODY)
        recorder.response_head(200, media)
    for chunk, now in zip(chunks, (now for _, now in framed), strict=True):
        one_by_one.chunk(chunk, now)
    for at in range(0, len(framed), run):
        reads = [(data, data.index(b"\r\n") + 2, len(data) - 2, now) for data, now in framed[at:at + run]]
        in_runs.reads_sink(reads, sum(end - start for _, start, end, _ in reads))
    first, second = one_by_one.finish(1.0), in_runs.finish(1.0)
    assert dataclasses.replace(second, started_at=first.started_at) == first
    assert first.bytes_out == sum(map(len, chunks)) and (first.output_tokens or media != SSE)


def test_a_server_limit_stop_says_the_numbers_behind_it() -> None:
    record = recorded("/v1/chat/completions", CHAT_BODY, openai_stream(10, "length", usage=True))
    assert record.length_cause == "server_limit"
    detail = record.length_cause_detail
    assert detail is not None
    assert "10 output tokens (the server's count) stopped below the requested budget of 64" in detail


@pytest.mark.parametrize(("message", "fields", "prompt", "context"), [
    # llama-server (tools/server/server-context.cpp; server-task.cpp adds n_prompt_tokens and n_ctx)
    ("request (352 tokens) exceeds the available context size (256 tokens), try increasing it",
     {"type": "exceed_context_size_error", "n_prompt_tokens": 352, "n_ctx": 256}, 352, 256),
    # vLLM 0.32 (vllm/renderers/params.py, _token_len_check)
    ("This model's maximum context length is 128 tokens. However, your prompt contains 300 input tokens, which "
     "exceeds this limit even without any output tokens. Please reduce the length of the input prompt.",
     {"type": "BadRequestError"}, 300, 128),
    # SGLang (python/sglang/srt/managers/tokenizer_manager.py, _validate_one_request)
    ("The input (5000 tokens) is longer than the model's context length (4096 tokens).", {}, 5000, 4096),
    ("Requested token count exceeds the model's maximum context length of 4096 tokens. You requested a total of "
     "4596 tokens: 4096 tokens from the input messages and 500 tokens for the completion. Please reduce the number "
     "of tokens in the input messages or the completion to fit within the limit.", {}, 4096, 4096),
])
def test_an_exceeds_context_refusal_gives_the_prompts_count_as_the_server_states_it(
        message: str, fields: dict[str, object], prompt: int, context: int) -> None:
    body = orjson.dumps({"error": {"code": 400, "message": message, **fields}})
    record = recorded("/v1/chat/completions", CHAT_BODY, [body], content_type="application/json", status=400)
    assert record.upstream_error == "exceeds_context"
    assert (record.prompt_tokens, record.prompt_tokens_source, record.context_tokens) == (
        prompt, "server_error", context)


def test_a_lower_bound_in_a_refusal_is_not_taken_as_the_prompts_count() -> None:
    message = ("This model's maximum context length is 128 tokens. However, your prompt contains at least 129 input "
               "tokens, which exceeds this limit even without any output tokens.")
    body = orjson.dumps({"error": {"code": 400, "message": message}})
    record = recorded("/v1/chat/completions", CHAT_BODY, [body], content_type="application/json", status=400)
    assert record.upstream_error == "exceeds_context" and record.prompt_tokens is None
