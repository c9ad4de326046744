"""Coverage-guided fuzzing of the response parsers with atheris (libFuzzer for Python).

Not part of the test suite (pytest does not collect it). Run, bounded in count and time:

    pip install atheris
    python tests/wire/fuzz/atheris_parsers.py -runs=200000 -max_total_time=120

One input picks the parser (first byte), a chunking (second byte seeds the cut points) and the
body (the rest). It fails when a parser raises, when the events depend on the chunking, or when
a line longer than the limit comes out of the line splitter.
"""

from __future__ import annotations

import random
import sys

import atheris

with atheris.instrument_imports():
    from proxy.wire.dialects import dialect_named
    from proxy.wire.events import Event, ParseError
    from proxy.wire.lines import LineSplitter
    from proxy.wire.parsers import ResponseParser, parser_for

KINDS = (
    ("openai", "text/event-stream", ""),
    ("ollama", "application/x-ndjson", ""),
    ("openai", "application/json", ""),
    ("llamacpp", "text/event-stream", ""),
    ("openai", "text/event-stream", "gzip"),
    ("ollama", "application/json", "deflate"),
    ("anthropic", "text/event-stream", ""),
    ("responses", "text/event-stream", ""),
)
MAX_LINE = 64


def _chunks(data: bytes, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    cuts = sorted(rng.randrange(len(data) + 1) for _ in range(rng.randrange(8))) if data else []
    pieces, last = [], 0
    for cut in cuts:
        pieces.append(data[last:cut])
        last = cut
    pieces.append(data[last:])
    return [p for p in pieces if p]


def _events(parser: ResponseParser, chunks: list[bytes]) -> tuple[list[Event], bool]:
    events: list[Event] = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    events.extend(parser.close())
    return [e for e in events if not isinstance(e, ParseError)], any(isinstance(e, ParseError) for e in events)


def test_one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    dialect, media, encoding = KINDS[data[0] % len(KINDS)]
    body = data[2:]

    def fresh() -> ResponseParser:
        return parser_for(dialect_named(dialect), media, encoding, max_line=MAX_LINE, body_cap=4096)

    chunked = _events(fresh(), _chunks(body, data[1]))
    if not encoding:  # a compressed body decodes in different pieces; only "never raises" holds there
        whole = _events(fresh(), [body])
        if chunked != whole:
            raise AssertionError(f"events depend on chunking: {chunked!r} != {whole!r}")
    splitter = LineSplitter(MAX_LINE)
    for chunk in _chunks(body, data[1]):
        for line in splitter.feed(chunk):
            if len(line) > MAX_LINE:
                raise AssertionError(f"a line of {len(line)} bytes passed a {MAX_LINE}-byte limit")


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
