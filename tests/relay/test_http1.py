"""HTTP/1.1 framing as pure functions, tested with bytes: the request head as it goes on the wire,
hop-by-hop fields left behind, chunked framing."""

from __future__ import annotations

from multidict import CIMultiDict, CIMultiDictProxy

from proxy.relay.http1 import (
    REQUEST_SKIP,
    RESPONSE_SKIP,
    chunk,
    end_to_end,
    last_chunk,
    request_head,
    response_head,
    spelling,
)


def test_the_request_head_is_host_first_then_the_clients_fields_in_their_order() -> None:
    headers = CIMultiDict([("Content-Type", "application/json"), ("X-B", "2"), ("x-a", "1"), ("X-B", "3")])
    assert request_head("POST", "/base/v1/chat/completions?x=1", "gpu-box:8000", headers) == (
        b"POST /base/v1/chat/completions?x=1 HTTP/1.1\r\nHost: gpu-box:8000\r\n"
        b"Content-Type: application/json\r\nX-B: 2\r\nx-a: 1\r\nX-B: 3\r\n\r\n")


def test_bytes_that_are_not_utf8_pass_in_the_head_as_they_came() -> None:
    value = b"caf\xe9".decode("utf-8", "surrogateescape")  # as aiohttp's parser hands them over
    assert request_head("GET", "/", "h", CIMultiDict([("X-Name", value)])).endswith(b"X-Name: caf\xe9\r\n\r\n")


def test_hop_by_hop_fields_and_those_connection_names_stay_behind() -> None:
    headers = CIMultiDictProxy(CIMultiDict([
        ("Host", "client-side"), ("Connection", "keep-alive, X-Hop"), ("Keep-Alive", "timeout=5"),
        ("X-Hop", "1"), ("TE", "trailers"), ("Transfer-Encoding", "chunked"), ("Upgrade", "h2c"),
        ("Proxy-Authorization", "Basic x"), ("Expect", "100-continue"), ("Content-Length", "12"),
        ("Authorization", "Bearer k"), ("Trailer", "X-Checksum"), ("X-End", "2")]))
    assert list(end_to_end(headers, REQUEST_SKIP).items()) == [
        ("Authorization", "Bearer k"), ("Trailer", "X-Checksum"), ("X-End", "2")]
    kept = end_to_end(headers, RESPONSE_SKIP)
    assert "Host" in kept and "Expect" in kept and "Content-Length" not in kept and "X-Hop" not in kept


def test_end_to_end_copies_and_leaves_the_original_alone() -> None:
    original = CIMultiDict([("Connection", "close"), ("A", "1")])
    assert list(end_to_end(original, RESPONSE_SKIP).items()) == [("A", "1")]
    assert list(original.items()) == [("Connection", "close"), ("A", "1")]


def test_chunked_framing() -> None:
    assert chunk(b"hello") == b"5\r\nhello\r\n"
    assert chunk(memoryview(b"x" * 26)) == b"1a\r\n" + b"x" * 26 + b"\r\n"
    assert chunk(bytearray(b"\r\n")) == b"2\r\n\r\n\r\n"
    assert last_chunk() == b"0\r\n\r\n"


def test_a_spelling_is_kept_only_for_the_names_the_parser_gives_its_own_case() -> None:
    raw = [(b"content-type", b"a"), (b"ETag", b"b"), (b"X-Custom", b"c"), (b"Content-Length", b"1"),
           (b"x-request-id", b"d"), (b"CONTENT-TYPE", b"e")]
    assert spelling(raw) == {"content-type": "content-type", "etag": "ETag", "x-request-id": "x-request-id"}
    assert spelling([(b"Content-Type", b"a"), (b"X-Custom", b"b")]) == {}  # the usual message: nothing to keep
    headers = CIMultiDict([("Content-Type", "a"), ("Etag", "b"), ("X-Custom", "c")])
    assert response_head("HTTP/1.1 200 OK", end_to_end(headers, frozenset(), raw)) == (
        b"HTTP/1.1 200 OK\r\ncontent-type: a\r\nETag: b\r\nX-Custom: c\r\n\r\n")
    assert request_head("GET", "/", "u:1", end_to_end(headers, frozenset(), raw)).startswith(
        b"GET / HTTP/1.1\r\nHost: u:1\r\ncontent-type: a\r\nETag: b\r\n")
