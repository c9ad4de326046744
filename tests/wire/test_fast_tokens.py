"""The fast path against the full parser: identical records over random streams, cut anywhere.

Streams are built the way the servers write them (vLLM's compact JSON, llama.cpp's sorted keys
and per-second `created`, Ollama's per-line `created_at`, Anthropic's named events, the
Responses API's `sequence_number`), with text that holds quotes, backslashes, escapes, non-ASCII
and the very byte patterns the fast path looks for; some events are garbled. Each stream is fed
in random reads to a Recorder with the fast path and to one without: the records must be equal.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.diagnosis.recorder import ParseLimits, Recorder
from proxy.wire import fast_tokens
from proxy.wire.dialects import dialect_named
from proxy.wire.fast_tokens import PlainTokens, ShapeMemory, _common_prefix, memory_of

TEXTS = ["tok ", "", " ", 'say "hi"', "back\\slash", "line\nbreak", "tab\there", "é漢🙂", "\u0001ctl",
         '"finish_reason":null', '","done":false}', "data: [DONE]", "\r\n", "{}", "\\u0041", "x" * 300]


def text(rng: random.Random) -> str:
    return rng.choice(TEXTS) if rng.random() < 0.5 else f"t{rng.randrange(1000)} "


def sse(obj: Any, *, spaced: bool = False, event: str | None = None) -> bytes:
    body = orjson.dumps(obj) if not spaced else orjson.dumps(obj, option=orjson.OPT_INDENT_2).replace(b"\n", b"")
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + body + b"\n\n"


def garble(rng: random.Random, event: bytes) -> bytes:
    if len(event) < 8 or rng.random() > 0.05:
        return event
    at = rng.randrange(6, len(event) - 2)
    return event[:at] + bytes([rng.randrange(256)]) + event[at + 1:]


def openai_events(rng: random.Random, longest: int = 40) -> list[bytes]:
    sorted_keys = rng.random() < 0.3  # llama.cpp (nlohmann::json sorts keys; `created` per second)
    created = 1733000000

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        nonlocal created
        if sorted_keys and rng.random() < 0.1:
            created += 1
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": created, "model": "m",
               "choices": [choice], **extra}
        if sorted_keys:
            obj = {k: obj[k] for k in sorted(obj)}
            obj["choices"] = [{k: choice[k] for k in sorted(choice)}]
        return sse(obj, spaced=rng.random() < 0.02)

    events = [chunk({"role": "assistant", "content": ""})]
    for _ in range(rng.randrange(0, longest)):
        roll = rng.random()
        if roll < 0.7:
            events.append(chunk({"content": text(rng)}))
        elif roll < 0.8:
            events.append(chunk({"reasoning_content" if rng.random() < 0.5 else "reasoning": text(rng)}))
        elif roll < 0.85:
            events.append(chunk({"tool_calls": [{"index": 0, "function": {"arguments": text(rng)}}]}))
        elif roll < 0.9:
            events.append(chunk({"content": text(rng)}, timings={"predicted_n": 3}))
        elif roll < 0.95:
            events.append(b": keep-alive\n\n")
        else:
            events.append(sse({"error": {"message": text(rng), "type": "server_error"}}))
    events.append(chunk({}, rng.choice(["stop", "length", "abort"])))
    if rng.random() < 0.6:
        events.append(sse({"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9}}))
    events.append(b"data: [DONE]\n\n")
    return events


def ollama_events(rng: random.Random) -> list[bytes]:
    chat = rng.random() < 0.7
    events = []
    for i in range(rng.randrange(0, 40)):
        stamp = f"2026-12-03T10:00:{i // 10:02d}.{rng.randrange(10**9):09d}Z"
        part: dict[str, Any] = {"role": "assistant", "content": text(rng)}
        if rng.random() < 0.15:
            part = {"role": "assistant", "content": "", "thinking": text(rng)}
        obj: dict[str, Any] = ({"model": "m", "created_at": stamp, "message": part, "done": False} if chat
                               else {"model": "m", "created_at": stamp, "response": part["content"], "done": False})
        events.append(orjson.dumps(obj) + b"\n")
    events.append(orjson.dumps({"model": "m", "created_at": "2026-12-03T10:01:00Z", "done": True,
                                "done_reason": rng.choice(["stop", "length"]), "eval_count": 9,
                                "prompt_eval_count": 3}) + b"\n")
    return events


def anthropic_events(rng: random.Random) -> list[bytes]:
    events = [sse({"type": "message_start", "message": {"usage": {"input_tokens": 3}}}, event="message_start"),
              sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                  event="content_block_start")]
    for _ in range(rng.randrange(0, 40)):
        if rng.random() < 0.8:
            delta = {"type": "text_delta", "text": text(rng)}
        else:
            delta = {"type": "thinking_delta", "thinking": text(rng)}
        events.append(sse({"type": "content_block_delta", "index": 0, "delta": delta}, event="content_block_delta"))
        if rng.random() < 0.05:
            events.append(sse({"type": "ping"}, event="ping"))
    events.append(sse({"type": "message_delta", "delta": {"stop_reason": rng.choice(["end_turn", "max_tokens"])},
                       "usage": {"output_tokens": 9}}, event="message_delta"))
    events.append(sse({"type": "message_stop"}, event="message_stop"))
    return events


def responses_events(rng: random.Random) -> list[bytes]:
    events = []
    for n in range(rng.randrange(0, 40)):
        kind = "response.output_text.delta" if rng.random() < 0.8 else "response.reasoning_text.delta"
        events.append(sse({"type": kind, "sequence_number": n, "item_id": "msg_1", "output_index": 0,
                           "content_index": 0, "delta": text(rng), "logprobs": []}, event=kind))
    events.append(sse({"type": "response.completed", "sequence_number": 99,
                       "response": {"status": "completed", "usage": {"output_tokens": 9, "input_tokens": 3}}},
                      event="response.completed"))
    return events


def llamacpp_events(rng: random.Random) -> list[bytes]:
    events = [sse({"content": text(rng), "stop": False, "id_slot": 0, "index": 0})
              for _ in range(rng.randrange(0, 40))]
    events.append(sse({"content": "", "stop": True, "stop_type": "eos", "tokens_predicted": 9, "index": 0}))
    return events


KINDS = {
    "openai": ("/v1/chat/completions", "text/event-stream", openai_events),
    "ollama": ("/api/chat", "application/x-ndjson", ollama_events),
    "anthropic": ("/v1/messages", "text/event-stream", anthropic_events),
    "responses": ("/v1/responses", "text/event-stream", responses_events),
    "llamacpp": ("/completion", "text/event-stream", llamacpp_events),
}


def record_of(path: str, media: str, reads: list[bytes], fast: bool) -> dict[str, Any]:
    recorder = Recorder.start("r", "POST", path, limits=ParseLimits(max_line_bytes=4096, fast_path=fast),
                              started=0.0)
    recorder.request_body(b'{"model":"m","max_tokens":40,"stream":true}')
    recorder.response_head(200, media)
    for at, chunk in enumerate(reads):
        recorder.chunk(chunk, 0.01 * (at + 1))
    record = recorder.finish(1.0).to_dict()
    del record["started_at"]
    return record


def cut(rng: random.Random, body: bytes, events: list[bytes] | None = None) -> list[bytes]:
    """Reads of `body`: whole, one event each (as servers write them; then a read of one plain
    token takes the shortest way), a few events each, or cut anywhere."""
    roll = rng.random()
    if events is not None and roll < 0.35:
        if rng.random() < 0.5:
            return [event for event in events if event]
        reads, at = [], 0
        while at < len(events):
            step = rng.choice((1, 1, 1, 2, 3))
            reads.append(b"".join(events[at:at + step]))
            at += step
        return [read for read in reads if read]
    if roll < 0.5:
        return [body]
    if len(body) < 2:
        return [body]
    cuts = sorted(rng.sample(range(1, len(body)), min(len(body) - 1, rng.randrange(1, 30))))
    edges = [0, *cuts, len(body)]
    return [body[a:b] for a, b in itertools.pairwise(edges) if b > a]


@settings(max_examples=400, deadline=None)
@given(kind=st.sampled_from(sorted(KINDS)), seed=st.integers(0, 2**32 - 1))
def test_fast_path_and_full_parser_give_identical_records(kind: str, seed: int) -> None:
    rng = random.Random(seed)
    path, media, build = KINDS[kind]
    events = [garble(rng, event) for event in build(rng)]
    if rng.random() < 0.1:
        events = [event.replace(b"\n", b"\r\n") for event in events]
    body = b"".join(events)
    reads = cut(rng, body, events)
    assert record_of(path, media, reads, fast=True) == record_of(path, media, reads, fast=False)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_long_streams_counted_read_by_read_give_the_records_of_the_full_parser(seed: int) -> None:
    """A read made only of plain events is counted whole (`_all_plain`): long streams, mostly plain
    tokens, some mixed in that are not (escapes, non-ASCII, reasoning, over the line limit), cut
    anywhere, must still give the full parser's record."""
    rng = random.Random(seed)
    events = [garble(rng, event) for event in openai_events(rng, longest=400)]
    if rng.random() < 0.3:  # a token past the line limit (4096 here) in the middle of a run
        at = rng.randrange(1, len(events))
        events.insert(at, events[at - 1].replace(b'"content":"', b'"content":"' + b"y" * 5000, 1))
    body = b"".join(events)
    reads = cut(rng, body, events) if rng.random() < 0.6 else [body[i:i + 700] for i in range(0, len(body), 700)]
    assert record_of("/v1/chat/completions", "text/event-stream", reads, fast=True) == \
        record_of("/v1/chat/completions", "text/event-stream", reads, fast=False)


class Counting:
    """A dialect's reading that counts the objects it decodes, and PlainTokens made with it."""

    def __init__(self, name: str) -> None:
        self.dialect = dialect_named(name)
        self.decoded: list[Any] = []

    def __call__(self, obj: Any) -> Any:
        self.decoded.append(obj)
        return self.dialect.events(obj)

    def tokens(self, memory: ShapeMemory | None = None) -> PlainTokens:
        return PlainTokens(self, self.dialect.token_keys, self.dialect.reasoning_keys, memory)

    def take(self, tokens: PlainTokens, events: Any) -> None:
        """Each event counted from its bytes, or else decoded (and its shape learned), as a parser does."""
        for event in events:
            if tokens.count(event) == -1:
                tokens.decoded(event, self(orjson.loads(event)))


def test_the_fast_path_takes_plain_events_without_decoding_them() -> None:
    """The point of it: after the first, plain tokens of a vLLM stream are not decoded."""
    reading = Counting("openai")
    tokens = [orjson.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1733000000,
                            "model": "m", "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "logprobs": None,
                                                       "finish_reason": None}]}) for i in range(20)]
    reading.take(reading.tokens(), tokens)
    assert len(reading.decoded) == 2  # the first event and the shape's check; the other 19 are counted from bytes


@pytest.mark.parametrize("kind", ["openai", "ollama"])
def test_a_read_of_one_plain_event_is_counted_without_the_decoder(kind: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """One event per read, as vLLM, llama.cpp and Ollama write them: once a shape is learned, such
    a read is counted whole (`_one`), before any splitting into lines or blocks."""
    path, media, _ = KINDS[kind]
    recorder = Recorder.start("r", "POST", path, started=0.0)
    recorder.request_body(b'{"model":"m","stream":true}')
    recorder.response_head(200, media)
    parser = recorder.tally.parser
    assert parser is not None
    split: list[bytes] = []
    feed_read = type(parser)._feed_read  # type: ignore[attr-defined]
    monkeypatch.setattr(type(parser), "_feed_read",
                        lambda self, chunk: (split.append(chunk), feed_read(self, chunk))[1])
    for n in range(6):
        if kind == "openai":
            read = sse({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                        "choices": [{"index": 0, "delta": {"content": f"tok{n} "}, "logprobs": None,
                                     "finish_reason": None}]})
        else:
            read = orjson.dumps({"model": "m", "created_at": f"2026-12-03T10:00:0{n}.1Z",
                                 "message": {"role": "assistant", "content": f"tok{n} "}, "done": False}) + b"\n"
        recorder.chunk(read, 0.01 * (n + 1))
    recorder.finish(1.0)  # the reads are parsed in runs: what is left, at the end
    assert recorder.tally.tokens == 6
    assert len(split) <= 2  # the first reads teach the shape (two for Ollama's created_at hole)


def test_a_shape_with_a_changing_scalar_learns_a_hole() -> None:
    """Ollama's created_at and the Responses API's sequence_number change every event."""
    dialect = dialect_named("responses")
    plain = PlainTokens(lambda obj: dialect.events(obj), dialect.token_keys, dialect.reasoning_keys)
    lines = [orjson.dumps({"type": "response.output_text.delta", "sequence_number": n, "delta": f"t{n}"})
             for n in range(5)]
    for line in lines[:2]:
        assert plain.count(line) == -1
        plain.decoded(line, dialect.events(orjson.loads(line)))
    assert [plain.count(line) for line in lines[2:]] == [1, 1, 1]
    assert plain.count(lines[2].replace(b'"t2"', b'"t\\"2"')) == 1  # an escaped quote is still plain
    assert plain.count(lines[2].replace(b'"t2"', b'"t\x012"')) == -1  # a raw control byte is not JSON


def ollama_line(n: int, model: str = "m") -> bytes:
    return orjson.dumps({"model": model, "created_at": f"2026-12-03T10:00:0{n % 10}.{n:06d}Z",
                         "message": {"role": "assistant", "content": f"tok{n} "}, "done": False})


def test_a_response_starts_with_the_shapes_the_last_one_of_its_dialect_learned() -> None:
    """Ollama's lines keep their shape from one answer to the next: the first answer learns it (its
    created_at hole too), the next ones count every token line without decoding one."""
    reading = Counting("ollama")
    memory = ShapeMemory()
    reading.take(reading.tokens(memory), [ollama_line(n) for n in range(6)])
    learned = len(reading.decoded)
    assert learned >= 2
    second = reading.tokens(memory)
    assert [second.count(ollama_line(n)) for n in range(10, 20)] == [1] * 10
    assert len(reading.decoded) == learned
    # Another model's lines are another shape: learned again, its checks decoded for it alone.
    assert reading.tokens(memory).count(ollama_line(30, model="other")) == -1


def test_a_check_is_decoded_once_for_its_dialect() -> None:
    """A shape's check (its bytes with the token emptied) is decoded for the first response that
    learns the shape; later responses that learn the same shape take the answer kept."""
    reading = Counting("openai")
    memory = ShapeMemory()
    for answer in range(3):
        role_first, plain = openai_pair(f"c{answer}")  # each answer its own id: its shapes learned again
        before = len(reading.decoded)
        reading.take(reading.tokens(memory), (role_first, plain, plain))
        # Each answer decodes its first two events (each a shape of its own) and their two checks.
        assert len(reading.decoded) - before == 4
    before = len(reading.decoded)
    reading.take(reading.tokens(memory), openai_pair("c1"))  # an answer again: its checks kept
    assert len(reading.decoded) - before == 2


def openai_pair(answer_id: str) -> tuple[bytes, bytes]:
    """An OpenAI-style answer's first token event (the role with it) and a later one."""
    return (orjson.dumps({"id": answer_id, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"}}]}),
            orjson.dumps({"id": answer_id, "choices": [{"index": 0, "delta": {"content": "b"}}]}))


def test_an_answers_first_event_and_its_usual_ones_are_both_kept_for_the_next() -> None:
    """An answer whose first token event also names the role has two shapes; both go to the next
    answer (one per kind would trade them every answer, learning both again each time). The
    latest comes first, the one without a hole that the whole-read fast path uses."""
    reading = Counting("openai")
    memory = ShapeMemory()
    role_first, plain = openai_pair("c")
    reading.take(reading.tokens(memory), (role_first, plain, plain))
    learned = len(reading.decoded)
    for _ in range(3):
        tokens = reading.tokens(memory)
        assert tokens.only is not None and tokens.only[0].endswith(b'"delta":{"content":"')
        reading.take(tokens, (role_first, plain, plain, plain))
    assert len(reading.decoded) == learned
    # Answers with ids of their own keep the shapes of no answer but their own: no hole across them.
    for answer in range(4):
        role_first, plain = openai_pair(f"chatcmpl-{answer}")
        tokens = reading.tokens(memory)
        reading.take(tokens, (role_first, plain, plain))
        assert len(tokens.shapes) == 2 and all(shape.hole is None for shape in tokens.shapes)
        assert tokens.only is not None and tokens.only[0].startswith(b'{"id":"chatcmpl-%d"' % answer)


def test_what_a_memory_keeps_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fast_tokens, "_MEMORIES", {})
    memory = ShapeMemory()
    calls: list[bytes] = []

    def decode(data: bytes) -> tuple[()]:
        calls.append(data)
        return ()

    for n in range(fast_tokens.MAX_CHECKS + 10):
        memory.decodes_to(b"%d" % n, decode)
    assert len(memory._checks) == fast_tokens.MAX_CHECKS
    assert b"0" not in memory._checks and b"%d" % (fast_tokens.MAX_CHECKS + 9) in memory._checks
    long = b"x" * (fast_tokens.CHECK_BYTES + 1)
    memory.decodes_to(long, decode)
    memory.decodes_to(long, decode)
    assert calls.count(long) == 2 and long not in memory._checks  # decoded each time, never kept
    shared = memory_of(dialect_named("openai").events, (b"a",), ())
    assert memory_of(dialect_named("openai").events, (b"a",), ()) is shared
    for n in range(fast_tokens.MAX_MEMORIES + 2):
        memory_of(lambda obj: [], (b"%d" % n,), ())
    assert len(fast_tokens._MEMORIES) <= fast_tokens.MAX_MEMORIES
    own = memory_of(lambda obj: [], (b"new",), ())
    assert own is not memory_of(lambda obj: [], (b"new",), ())


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(sorted(KINDS)), seeds=st.lists(st.integers(0, 2**32 - 1), min_size=2, max_size=6))
def test_answers_in_a_row_give_the_records_of_the_full_parser(kind: str, seeds: list[int]) -> None:
    """Each answer starts with the shapes of the one before it, whatever they were (another id,
    another model, a role in the first token's event, reasoning): the records are still those of
    the full parser, answer after answer."""
    path, media, build = KINDS[kind]
    for seed in seeds:
        rng = random.Random(seed)
        events = [garble(rng, event) for event in build(rng)]
        if rng.random() < 0.5:  # another answer's id, or another model
            events = [event.replace(b"chatcmpl-1", b"chatcmpl-%d" % seed).replace(b'"model":"m"', b'"model":"n"')
                      for event in events]
        body = b"".join(events)
        reads = cut(rng, body, events)
        assert record_of(path, media, reads, fast=True) == record_of(path, media, reads, fast=False)


@given(st.binary(max_size=40), st.binary(max_size=8), st.binary(max_size=8))
def test_the_shared_prefix_is_found_by_halving_as_byte_by_byte(shared: bytes, a_tail: bytes, b_tail: bytes) -> None:
    a, b = shared + a_tail, shared + b_tail
    expected = 0
    while expected < min(len(a), len(b)) and a[expected] == b[expected]:
        expected += 1
    assert _common_prefix(a, b) == expected == _common_prefix(b, a)


@pytest.mark.parametrize("read_size", [64, 700, 4096, 1 << 20])
def test_whole_reads_of_plain_events_keep_the_blank_line_rules(read_size: int) -> None:
    """Extra blank lines between and after events (a third LF at a read's end among them) give the
    full parser's record when whole reads of plain events are counted at once."""
    rng = random.Random(read_size)
    events = [sse({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1733000000, "model": "m",
                   "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}]})]
    for i in range(300):
        event = sse({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1733000000, "model": "m",
                     "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "logprobs": None,
                                  "finish_reason": None}]})
        events.append(event + b"\n" * rng.choice([0, 0, 0, 1, 2]))
    events.append(b"data: [DONE]\n\n")
    body = b"".join(events)
    reads = [body[i:i + read_size] for i in range(0, len(body), read_size)]
    fast = record_of("/v1/chat/completions", "text/event-stream", reads, fast=True)
    assert fast == record_of("/v1/chat/completions", "text/event-stream", reads, fast=False)
    assert fast["output_tokens"] == 300


@pytest.mark.parametrize("kind", ["openai", "ollama"])
def test_a_run_of_one_event_reads_with_others_among_them_is_counted_as_the_decoder_counts(kind: str) -> None:
    """The tally takes a run of reads (stream_tally.RUN_READS) and the parser counts, in one loop,
    those that are one plain token each (`plain_reads`); a read of anything else among them (an
    escape, non-ASCII text, an empty token, thinking, one past the line limit, two events, a
    torn one) breaks the loop there and is parsed alone. The record is the full parser's."""
    path, media, _ = KINDS[kind]

    def event(content: str, field: str = "content") -> bytes:
        if kind == "openai":
            return sse({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                        "choices": [{"index": 0, "delta": {field: content}, "logprobs": None,
                                     "finish_reason": None}]})
        return orjson.dumps({"model": "m", "message": {"role": "assistant", field: content}, "done": False}) + b"\n"

    odd = [event('say "hi"'), event("été "), event(""), event("y" * 5000), event("a") + event("b")]
    reads = [event(f"tok{n} ") for n in range(3)]
    for n, other in enumerate(odd * 4):
        reads += [other, *(event(f"w{n}.{i} ") for i in range(n % 5))]
    torn = event("torn ")
    reads += [torn[:7], torn[7:], *(event(f"end{n} ") for n in range(40))]
    thinking = event("hmm", "reasoning_content" if kind == "openai" else "thinking")  # a second shape
    reads += [thinking, *(event(f"after{n} ") for n in range(20))]
    assert record_of(path, media, reads, fast=True) == record_of(path, media, reads, fast=False)
