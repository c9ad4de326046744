"""The chunked framing the relay passes through: what it relays is what came, cut anywhere, and
what is not sound framing is refused before a byte of it is relayed."""

from __future__ import annotations

import itertools
import random

import pytest

from proxy.relay import chunked
from proxy.relay.chunked import MAX_LINE, ChunkedBody, FramingError, chunk_start, one_chunk

TRAILERS = [b"", b"X-Sum: 42\r\n", b"X-A: 1\r\nX-B: two words\r\n", b"not a field line\r\n"]


def reads_of(rng: random.Random, wire: bytes) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(wire)), min(len(wire) - 1, rng.randrange(0, 10))))
    return [wire[a:b] for a, b in itertools.pairwise([0, *cuts, len(wire)])]


@pytest.mark.parametrize("seed", range(300))
def test_cut_anywhere_it_relays_the_chunks_as_they_came_and_the_payload_exactly(seed: int) -> None:
    rng = random.Random(seed)
    chunks = [rng.randbytes(rng.randrange(1, 300)) for _ in range(rng.randrange(0, 8))]
    body = b"".join(b"%x%s\r\n%s\r\n" % (len(c), rng.choice([b"", b";ext=1", b" ;x"]), c) for c in chunks)
    trailers = rng.choice(TRAILERS)
    extra = rng.choice([b"", b"HTTP/1.1 200 OK\r\n"])
    framing = ChunkedBody()
    relayed, payload, read = b"", b"", 0
    reads = reads_of(rng, body + b"0\r\n" + trailers + b"\r\n" + extra)
    while not framing.done:
        whole = one_chunk(reads[read]) if framing.between_chunks else None
        out, pieces = framing.feed(reads[read])
        if whole is not None:  # the relay's short way gives what feed gives
            assert (out, pieces) == (reads[read], [whole])
        read += 1
        relayed += out
        payload += b"".join(pieces)
    assert relayed == body and payload == b"".join(chunks)
    valid = trailers if trailers and b":" in trailers else b""
    assert framing.ending() == b"0\r\n" + valid + b"\r\n"
    assert framing.extra == (bool(extra) and len(b"".join(reads[:read])) > len(body) + len(trailers) + 5)


def test_a_read_of_one_chunk_is_relayed_whole() -> None:
    read = b"b\r\ndata: tok\n\n\r\n"
    assert ChunkedBody().feed(read) == (read, [b"data: tok\n\n"])
    assert one_chunk(read) == b"data: tok\n\n" and one_chunk(read + b"0") is None and one_chunk(b"0\r\n\r\n") is None
    framing = ChunkedBody()
    framing.feed(b"5\r\nhel")
    assert not framing.between_chunks  # inside a chunk: a read that looks like one is data


def test_a_size_line_split_between_reads_is_held_until_it_is_whole() -> None:
    framing = ChunkedBody()
    assert framing.feed(b"3\r\nabc\r\n1") == (b"3\r\nabc\r\n", [b"abc"])
    assert framing.feed(b"0\r\n0123456789abcdef\r\n") == (b"10\r\n0123456789abcdef\r\n", [b"0123456789abcdef"])


@pytest.mark.parametrize("wire", [b"g\r\nxx\r\n", b"5\r\nhelloXX", b"5\nhello\r\n", b"5;\x01\r\nhello\r\n",
                                  b"1" * 17 + b"\r\n", b"\r\n", b"-5\r\nhello\r\n"])
def test_what_is_not_chunked_framing_is_refused(wire: bytes) -> None:
    framing = ChunkedBody()
    with pytest.raises(FramingError):
        for byte in range(len(wire)):  # byte by byte: nothing slips through a read boundary
            framing.feed(wire[byte:byte + 1])


def test_a_trailer_section_that_is_not_field_lines_is_dropped_not_relayed() -> None:
    framing = ChunkedBody()
    assert framing.feed(b"5\r\nhello\r\n0\r\nX: \x00\r\n\r\n") == (b"5\r\nhello\r\n", [b"hello"])
    assert framing.done and framing.ending() == b"0\r\n\r\n"


def test_lines_are_bounded() -> None:
    with pytest.raises(FramingError):
        ChunkedBody().feed(b"1" * (MAX_LINE + 1))
    framing = ChunkedBody()
    framing.feed(b"0\r\n")
    with pytest.raises(FramingError):
        for _ in range(100):
            framing.feed(b"X-Pad: " + b"p" * 1000 + b"\r\n")


def test_chunk_sizes_are_read_the_same_through_the_bounded_memo_of_size_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunked, "_SIZE_LINES", {})
    monkeypatch.setattr(chunked, "SIZE_LINES_KEPT", 8)
    for size in range(1, 40):
        for line in (b"%x" % size, b"%X" % size, b"00%x" % size):
            read = line + b"\r\n" + b"z" * size + b"\r\n"
            assert chunk_start(read) == len(line) + 2 and one_chunk(read) == b"z" * size  # twice: memo or not
            assert chunk_start(read) == len(line) + 2
            assert chunk_start(read + b"x") == 0 and chunk_start(read[:-1]) == 0
    assert len(chunked._SIZE_LINES) == 8
    assert chunk_start(b"+5\r\nhello\r\n") == 0 and chunk_start(b"0x5\r\nhello\r\n") == 0  # int() would take them
    assert chunk_start(b"0\r\n\r\n") == 0  # the last chunk is not a chunk of payload
