"""HTTP/1.1 framing rules the relay keeps, as pure functions of a message's parts (RFC 9112).

What a reverse proxy may pass on and what it must refuse: a request it cannot forward as sent (a
tunnel, a request line without a version, a transfer coding it does not relay), a response it must
not relay (an upgrade nobody asked for, a transfer coding it would lose), the hop-by-hop fields
each hop sets for itself, the request head as it goes on the wire, chunked framing, and the
trailer section of a chunked body, which it passes on as it came.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from aiohttp import hdrs
from multidict import CIMultiDict, CIMultiDictProxy, istr

# RFC 9110 section 7.6.1 hop-by-hop fields, plus the ones aiohttp computes itself. `Trailer` (which
# fields a trailer section holds) is end to end: it goes with the trailers the proxy passes on.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailers", "transfer-encoding", "upgrade",
})
# `Expect: 100-continue` is answered by the proxy itself (it reads the body before it connects): sent
# on, the upstream would wait for a body the proxy has already sent, or the client for a second 100.
REQUEST_SKIP = HOP_BY_HOP | {"host", "content-length", "expect"}
RESPONSE_SKIP = HOP_BY_HOP | {"content-length"}

# A field's name is a token; a field line of a trailer section is a token, a colon, a value without
# CR, LF or NUL (RFC 9110 5.1, 5.5).
_TOKEN = "[!#$%&'*+\\-.^_`|~0-9A-Za-z]+"
_FIELD_NAME = re.compile(_TOKEN)
_FIELD_LINE = re.compile(_TOKEN.encode() + rb":[\t\x20-\x7e\x80-\xff]*")
_LAST_CHUNK = re.compile(rb"0+(?:[\t ]*;[^\r\n]*)?")
MAX_TRAILER_BYTES = 8192


def is_field_name(name: str) -> bool:
    """`name` can name a header field: a request could carry it."""
    return _FIELD_NAME.fullmatch(name) is not None


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request cannot be forwarded as it came: the status, the error type and its words."""

    status: int
    kind: str
    message: str
    reason: str  # the bounded label of llm_proxy_invalid_requests_total


def transfer_codings(value: str | None) -> list[str]:
    """The codings a Transfer-Encoding lists, lower case, in order."""
    if not value:
        return []
    return [coding.strip().lower() for coding in value.split(",") if coding.strip()]


def only_chunked(value: str | None) -> bool:
    """No transfer coding but chunked (the one a proxy reframes; any other would be lost)."""
    return all(coding == "chunked" for coding in transfer_codings(value))


def request_refusal(method: str, version: tuple[int, int], target: str,
                    transfer_encoding: str | None) -> Refusal | None:
    """What the relay refuses to forward, before any byte goes upstream:
    - CONNECT: a tunnel, which a reverse proxy in front of one server does not open (RFC 9110 9.3.6);
    - a request line with no HTTP version (HTTP/0.9's `GET /x`): no headers, no framing to relay;
    - a transfer coding other than chunked (RFC 9112 6.1: 501 for a coding the server does not relay);
    - the asterisk-form `*` with any method but OPTIONS (RFC 9112 3.2.4)."""
    if method == "CONNECT":
        return Refusal(405, "method_not_allowed", "CONNECT is not forwarded: this is a reverse proxy in front of one "
                       "server, not a tunnel", "connect")
    if version < (1, 0):
        return Refusal(400, "bad_request", "the request line has no HTTP version (HTTP/0.9 is not relayed)",
                       "http_0_9")
    if not only_chunked(transfer_encoding):
        return Refusal(501, "not_implemented", "a transfer coding other than chunked is not relayed",
                       "transfer_coding")
    if target == "*" and method != "OPTIONS":
        return Refusal(400, "bad_request", "the asterisk-form target is only for OPTIONS", "bad_request_line")
    return None


def end_to_end(headers: CIMultiDictProxy[str] | CIMultiDict[str], skip: frozenset[str],
               raw: Iterable[tuple[bytes, bytes]] = ()) -> CIMultiDict[str]:
    """`headers` less the `skip` fields and those the `Connection` field names (RFC 9110 7.6.1), each
    name as its sender spelled it (`raw`: the fields as they came; see `spelling`). Copied whole,
    then pruned: most messages carry none of them. A field the relay sets afterwards is its own,
    spelled its way."""
    spelled = spelling(raw)
    if spelled:
        out = CIMultiDict((spelled.get(name.lower(), name), value) for name, value in headers.items())
    else:
        out = headers.copy()
    connection = headers.get("Connection")
    if connection is not None:
        for token in connection.split(","):
            out.popall(token.strip(), None)
    for name in skip:
        if name in out:
            del out[name]
    return out


def spelling(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """The names of a message's fields as they came, where aiohttp's parser gave them another case:
    it names a field it knows in its own spelling (`content-type` comes out `Content-Type`, `ETag`
    `Etag`), and a proxy passes the names on as it got them (uvicorn, vLLM's server, sends them
    lower-case). Empty when every name came as the parser names it, the usual message."""
    found: dict[str, str] = {}
    for name, _ in raw:
        text = name.decode("utf-8", "surrogateescape")
        if text not in _AS_PARSED:
            lower = text.lower()
            if lower in _KNOWN:  # (a name it does not know keeps its case)
                found.setdefault(lower, text)
    return found


# The spellings aiohttp's parser gives the fields it knows: a name that came so needs no spelling.
_AS_PARSED = frozenset(str(name) for name in vars(hdrs).values() if isinstance(name, istr))
_KNOWN = frozenset(name.lower() for name in _AS_PARSED)


def request_head(method: str, target: str, authority: str, headers: CIMultiDict[str]) -> bytes:
    """The request line and header block, as they go on the wire: `Host` first, then the rest in
    the client's order. Values came through aiohttp's server parser (no CR or LF); bytes that are
    not UTF-8 pass as they came (surrogateescape)."""
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {authority}\r\n"]
    lines.extend(f"{name}: {value}\r\n" for name, value in headers.items())
    lines.append("\r\n")
    return "".join(lines).encode("utf-8", "surrogateescape")


def response_head(status_line: str, headers: CIMultiDict[str]) -> bytes:
    """The status line and header block of a relayed response, as they go on the wire: the fields in
    their order, bytes that are not UTF-8 as the upstream sent them (surrogateescape; aiohttp's own
    serializer drops them). A CR or LF inside a line is refused (ValueError), as aiohttp refuses it."""
    lines = [f"{status_line}\r\n"]
    lines.extend(f"{name}: {value}\r\n" for name, value in headers.items())
    lines.append("\r\n")
    head = "".join(lines)
    if head.count("\n") != len(lines) or head.count("\r") != len(lines):
        raise ValueError("Newline or carriage return character detected in HTTP status/headers")
    return head.encode("utf-8", "surrogateescape")


def chunk(piece: bytes | bytearray | memoryview) -> bytes:
    """One piece of a body as a chunk (RFC 9112 7.1): its size in hex, CRLF, the bytes, CRLF."""
    return b"%x\r\n" % len(piece) + bytes(piece) + b"\r\n"


def last_chunk() -> bytes:
    """The end of a chunked body with no trailer fields."""
    return b"0\r\n\r\n"


def origin_target(raw_target: str, path_qs: str) -> str:
    """The client's request target in origin form (its path and query, `path_qs` as aiohttp's URL
    gives it), with the empty query it may have ended with: the URL drops it (`/v1/models?` comes
    out `/v1/models`), and a proxy passes the target as it came. `raw_target`: the target as written
    (a fragment there is never sent on)."""
    if "?" not in path_qs and raw_target.partition("#")[0].endswith("?"):
        return path_qs + "?"
    return path_qs


def upstream_target(prefix: str, target: str) -> str:
    """The request target the upstream gets: the upstream URL's path before the client's, except the
    asterisk-form of OPTIONS, which names the server itself and stays `*`."""
    return target if target == "*" else prefix + target


def trailer_section(tail: bytes) -> bytes | None:
    """The trailer fields at the end of a chunked body's raw bytes (`tail`: its last bytes, ending with
    the final CRLF), as they came, each line with its CRLF; None when there are none (or `tail` does
    not end a chunked body as RFC 9112 7.1 frames it)."""
    if not tail.endswith(b"\r\n\r\n"):
        return None
    lines = tail[:-2].split(b"\r\n")[:-1]  # the lines before the final empty one
    fields: list[bytes] = []
    for line in reversed(lines):
        if _LAST_CHUNK.fullmatch(line):
            break
        if not _FIELD_LINE.fullmatch(line):
            return None
        fields.append(line)
    else:
        return None  # no last-chunk line within the tail
    if not fields:
        return None
    section = b"".join(line + b"\r\n" for line in reversed(fields))
    return section if len(section) <= MAX_TRAILER_BYTES else None
