"""HTTP/1.1 framing rules the relay keeps, as pure functions of a message's parts (RFC 9112).

What a reverse proxy may pass on and what it must refuse: a request it cannot forward as sent (a
tunnel, a request line without a version, a transfer coding it does not relay), a response it must
not relay (an upgrade nobody asked for, a transfer coding it would lose), and the trailer section
of a chunked body, which it passes on as it came.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# A field line of a trailer section: a token, a colon, a value without CR, LF or NUL (RFC 9110 5.1, 5.5).
_FIELD_LINE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\t\x20-\x7e\x80-\xff]*")
_LAST_CHUNK = re.compile(rb"0+(?:[\t ]*;[^\r\n]*)?")
MAX_TRAILER_BYTES = 8192


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
