"""Fuzzing the response parsers: arbitrary and mutated SSE/NDJSON bytes, in any chunking.

Properties: a parser never raises out of its boundary; what it reports does not depend on how
the bytes were chunked (so neither does the stop reason of a valid stream); its work and its
memory grow in proportion to its input, never faster. `FUZZ_EXAMPLES` raises the example
count (the figures in docs/reliability.md come from FUZZ_EXAMPLES=5000).
"""

from __future__ import annotations

import gzip
import os
import time
import tracemalloc
from collections.abc import Callable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.diagnosis.recorder import ParseLimits, Recorder
from proxy.wire.dialects import dialect_named
from proxy.wire.events import Event, ParseError, TokenDelta
from proxy.wire.lines import LineSplitter
from proxy.wire.parsers import ResponseParser, parser_for
from proxy.wire.sse import SseDecoder
from tests.support.chunking import split_at
from tests.support.wire import anthropic_stream, ollama_stream, openai_stream, responses_stream

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MIB = 1 << 20

KINDS = {  # (dialect, content type, content encoding)
    "openai-sse": ("openai", "text/event-stream", ""),
    "ollama-ndjson": ("ollama", "application/x-ndjson", ""),
    "openai-json": ("openai", "application/json", ""),
    "ollama-json": ("ollama", "application/json", ""),
    "llamacpp-sse": ("llamacpp", "text/event-stream", ""),
    "openai-sse-gzip": ("openai", "text/event-stream", "gzip"),
    "anthropic-sse": ("anthropic", "text/event-stream", ""),
    "anthropic-json": ("anthropic", "application/json", ""),
    "responses-sse": ("responses", "text/event-stream", ""),
    "responses-json": ("responses", "application/json", ""),
}
PLAIN_KINDS = [k for k, v in KINDS.items() if not v[2]]


def make_parser(kind: str, max_line: int = 256, body_cap: int = 4096) -> ResponseParser:
    dialect, media, encoding = KINDS[kind]
    return parser_for(dialect_named(dialect), media, encoding, max_line=max_line, body_cap=body_cap)


def seen(events: list[Event]) -> tuple[list[Event], int, int, bool]:
    """What the diagnosis uses: the events other than tokens in order, the visible and reasoning
    token totals (the fast path counts a read's plain tokens into one TokenDelta), and whether any
    part could not be read (a parser reports over-long lines once per chunk, so their count and
    place depend on chunking)."""
    tokens = [e for e in events if isinstance(e, TokenDelta)]
    return ([e for e in events if not isinstance(e, (ParseError, TokenDelta))],
            sum(t.count for t in tokens if not t.reasoning), sum(t.count for t in tokens if t.reasoning),
            any(isinstance(e, ParseError) for e in events))


def events_of(parser: ResponseParser, chunks: list[bytes]) -> list[Event]:
    events: list[Event] = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    events.extend(parser.close())
    return events


def stop_reason_of(kind: str, chunks: list[bytes]) -> tuple[str, int, int | None]:
    """(stop reason, tokens counted, usage tokens) as the forwarding path would find them."""
    dialect, media, encoding = KINDS[kind]
    recorder = Recorder.start("fuzz", "POST", dialect_named(dialect).routes[0],
                              limits=ParseLimits(1 << 16, 1 << 20), started=0.0)
    recorder.response_head(200, media, encoding)
    for index, chunk in enumerate(chunks):
        recorder.chunk(chunk, float(index))
    record = recorder.finish(float(len(chunks)))
    usage = record.output_tokens if record.tokens_source == "usage" else None
    return record.stop_reason, recorder.tally.tokens, usage


# --- inputs ------------------------------------------------------------------------------------

@st.composite
def valid_streams(draw: st.DrawFn) -> tuple[str, bytes]:
    """A whole, valid stream as a real server sends it, in one of the line-ending styles SSE allows."""
    tokens = draw(st.integers(0, 12))
    family = draw(st.sampled_from(["openai", "ollama", "anthropic", "responses"]))
    if family == "anthropic":
        reason = draw(st.sampled_from(["end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal"]))
        body = b"".join(anthropic_stream(tokens, reason, thinking=draw(st.integers(0, 3)),
                                         usage=draw(st.booleans()), tool=reason == "tool_use"))
        return "anthropic-sse", body.replace(b"\n", draw(st.sampled_from([b"\n", b"\r\n", b"\r"])))
    if family == "responses":
        status = draw(st.sampled_from(["completed", "incomplete"]))
        body = b"".join(responses_stream(tokens, status, reason="max_output_tokens" if status == "incomplete" else None,
                                         reasoning=draw(st.integers(0, 3)), usage=draw(st.booleans())))
        return "responses-sse", body
    if family == "openai":
        reason = draw(st.sampled_from(["stop", "length", "tool_calls", "content_filter"]))
        body = b"".join(openai_stream(tokens, reason, usage=draw(st.booleans()),
                                      stop_reason=draw(st.sampled_from([None, "###", 128009]))))
        ending = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
        return "openai-sse", body.replace(b"\n", ending)
    body = b"".join(ollama_stream(tokens, draw(st.sampled_from(["stop", "length"])), chat=draw(st.booleans())))
    return "ollama-ndjson", body


def mutate(data: bytes, draw: st.DrawFn) -> bytes:
    """Flip, insert, delete, duplicate or cut bytes; line breaks and colons are favoured."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 6))):
        if not out:
            out += draw(st.binary(min_size=1, max_size=8))
            continue
        at = draw(st.integers(0, len(out) - 1))
        action = draw(st.sampled_from(["flip", "insert", "delete", "duplicate", "truncate", "break"]))
        if action == "flip":
            out[at] ^= 1 << draw(st.integers(0, 7))
        elif action == "insert":
            out[at:at] = draw(st.binary(max_size=16))
        elif action == "delete":
            del out[at:at + draw(st.integers(1, 16))]
        elif action == "duplicate":
            size = draw(st.integers(1, 64))
            out[at:at] = out[at:at + size]
        elif action == "truncate":
            del out[at:]
        else:
            out[at:at] = draw(st.sampled_from([b"\n", b"\r", b"\r\n", b"\n\n", b":", b"data:", b"{", b"\x00"]))
    return bytes(out)


@st.composite
def mutated_streams(draw: st.DrawFn) -> tuple[str, bytes]:
    kind, body = draw(valid_streams())
    return kind, mutate(body, draw)


CUTS = st.lists(st.integers(0, 1 << 16), max_size=40)


# --- never raises ------------------------------------------------------------------------------

@FUZZ
@given(kind=st.sampled_from(list(KINDS)), data=st.binary(max_size=2048), cuts=CUTS)
def test_any_bytes_in_any_chunking_never_raise(kind: str, data: bytes, cuts: list[int]) -> None:
    events = events_of(make_parser(kind), split_at(data, cuts))
    assert all(isinstance(e, Event) for e in events)


@FUZZ
@given(stream=mutated_streams(), cuts=CUTS, gzipped=st.booleans())
def test_mutated_streams_in_any_chunking_never_raise(stream: tuple[str, bytes], cuts: list[int],
                                                      gzipped: bool) -> None:
    kind, body = stream
    if gzipped and kind == "openai-sse":
        kind, body = "openai-sse-gzip", mutate_gzip(body, cuts)
    events = events_of(make_parser(kind), split_at(body, cuts))
    assert all(isinstance(e, Event) for e in events)


def mutate_gzip(body: bytes, cuts: list[int]) -> bytes:
    packed = bytearray(gzip.compress(body))
    for cut in cuts[:3]:  # corrupt a few bytes of the compressed form
        packed[cut % len(packed)] ^= 0x5A
    return bytes(packed)


# --- chunking does not change what is seen ----------------------------------------------------

@FUZZ
@given(stream=valid_streams(), cuts=CUTS)
def test_stop_reason_of_a_valid_stream_does_not_depend_on_its_chunking(stream: tuple[str, bytes],
                                                                       cuts: list[int]) -> None:
    kind, body = stream
    whole = stop_reason_of(kind, [body])
    assert stop_reason_of(kind, split_at(body, cuts)) == whole
    assert stop_reason_of(kind, [body[i:i + 1] for i in range(len(body))]) == whole  # byte by byte
    assert whole[0] in ("eos", "stop_sequence", "length", "tool_calls", "content_filter")


@FUZZ
@given(stream=mutated_streams(), cuts=CUTS)
def test_events_of_mutated_streams_do_not_depend_on_chunking(stream: tuple[str, bytes], cuts: list[int]) -> None:
    kind, body = stream
    assert seen(events_of(make_parser(kind), split_at(body, cuts))) == seen(events_of(make_parser(kind), [body]))


@FUZZ
@given(kind=st.sampled_from(PLAIN_KINDS), data=st.binary(max_size=1024), cuts=CUTS,
       max_line=st.integers(1, 64))
def test_events_of_arbitrary_bytes_do_not_depend_on_chunking(kind: str, data: bytes, cuts: list[int],
                                                             max_line: int) -> None:
    chunked = events_of(make_parser(kind, max_line=max_line), split_at(data, cuts))
    assert seen(chunked) == seen(events_of(make_parser(kind, max_line=max_line), [data]))


@FUZZ
@given(data=st.binary(max_size=512).map(lambda b: b.replace(b"\0", b"\n")), cuts=CUTS, max_line=st.integers(1, 32))
def test_line_splitter_output_does_not_depend_on_chunking(data: bytes, cuts: list[int], max_line: int) -> None:
    def lines_of(chunks: list[bytes]) -> tuple[list[bytes], int]:
        splitter = LineSplitter(max_line)
        out: list[bytes] = []
        for chunk in chunks:
            out.extend(splitter.feed(chunk))
        out.extend(splitter.close())
        return out, splitter.overlong

    lines, overlong = lines_of(split_at(data, cuts))
    assert (lines, overlong) == lines_of([data])
    assert all(len(line) <= max_line for line in lines)


# --- work and memory in proportion to the input -----------------------------------------------

def best_time(run: Callable[[], object], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def feed_in_pieces(kind: str, data: bytes, piece: int, max_line: int = 4 * MIB) -> Callable[[], object]:
    def run() -> object:
        parser = make_parser(kind, max_line=max_line, body_cap=32 * MIB)
        for start in range(0, len(data), piece):
            parser.feed(data[start:start + piece])
        return parser.close()

    return run


PATHOLOGICAL: dict[str, Callable[[int], bytes]] = {
    # valid events, the common case
    "sse events": lambda size: (b'data: {"choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'
                                * (size // 57 + 1))[:size],
    "ndjson lines": lambda size: (b'{"message":{"content":"tok"},"done":false}\n' * (size // 43 + 1))[:size],
    # one line that never ends
    "no newline": lambda size: b"data: " + b"x" * size,
    # an event that never dispatches: data lines with no blank line between them
    "endless event": lambda size: b"data: x\n" * (size // 8),
    # line endings only
    "lone CRs": lambda size: b"\r" * size,
    "blank lines": lambda size: b"\n" * size,
}


def test_ten_times_the_input_takes_about_ten_times_the_work() -> None:
    ratios = {}
    for name, build in PATHOLOGICAL.items():
        kind = "ollama-ndjson" if name.startswith("ndjson") else "openai-sse"
        small, large = build(MIB), build(10 * MIB)
        t_small = best_time(feed_in_pieces(kind, small, 16 * 1024))
        t_large = best_time(feed_in_pieces(kind, large, 16 * 1024), repeat=2)
        ratios[name] = t_large / max(t_small, 1e-4)
    print("\n10 MiB / 1 MiB parse time: " + ", ".join(f"{k} {v:.1f}x" for k, v in ratios.items()))
    # linear is 10x; quadratic would be 100x. The margin is for a loaded two-core machine.
    assert all(ratio < 30 for ratio in ratios.values()), ratios


def test_small_chunks_cost_in_proportion_too() -> None:
    data = PATHOLOGICAL["no newline"](256 * 1024)
    t_small = best_time(feed_in_pieces("openai-sse", data[: 64 * 1024], 16, max_line=MIB))
    t_large = best_time(feed_in_pieces("openai-sse", data, 16, max_line=MIB), repeat=2)
    print(f"\n16-byte chunks, 256 KiB / 64 KiB: {t_large / t_small:.1f}x")
    assert t_large / t_small < 4 * 3


def traced_growth(run: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_parser_memory_stays_bounded_by_the_line_limit_whatever_the_stream() -> None:
    max_line = 256 * 1024
    for name in ("no newline", "endless event", "sse events"):
        data = PATHOLOGICAL[name](16 * MIB)
        chunks = [data[i:i + 64 * 1024] for i in range(0, len(data), 64 * 1024)]

        def run(chunks: list[bytes] = chunks) -> object:
            parser = make_parser("openai-sse", max_line=max_line)
            for chunk in chunks:
                parser.feed(chunk)
            return parser

        peak = traced_growth(run)
        print(f"\n{name}: 16 MiB fed, parser peak {peak / MIB:.2f} MiB (line limit {max_line // 1024} KiB)")
        assert peak < 4 * max_line + MIB, name


def test_sse_event_with_endless_data_lines_is_dropped_and_reported() -> None:
    decoder = SseDecoder(1024)
    for _ in range(1000):
        assert decoder.feed(b"data: x\n" * 100) == []
    assert decoder.overlong_lines == 1
    assert decoder.feed(b"\ndata: ok\n\n") == [(None, b"ok")]  # the next event is read again
