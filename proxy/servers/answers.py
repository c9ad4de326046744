"""The answers the proxy asks a server for itself (its tokenizer, `/props`, `/v1/models`, its
`/metrics`), read whole: to their end, or to a stated cap.

`response.content.read(n)` returns what is buffered, not the whole body: an answer that comes in two
writes (any answer larger than a TCP window across a network, a vLLM `/tokenize` of a long prompt,
a 100 KB `/metrics` page) would be cut at the first. Every caller bounds the time as well
(`asyncio.timeout` around the request and the read).
"""

from __future__ import annotations

import aiohttp


class AnswerTooLarge(Exception):
    """The answer is larger than the cap its reader set."""


async def read_whole(response: aiohttp.ClientResponse, cap: int) -> bytes:
    """The whole body, however many reads it comes in; AnswerTooLarge past `cap` bytes (a declared
    length over it is refused before a byte is read)."""
    if response.content_length is not None and response.content_length > cap:
        raise AnswerTooLarge(f"the answer is {response.content_length:,} bytes, over {cap:,}")
    parts: list[bytes] = []
    size = 0
    async for part in response.content.iter_any():
        size += len(part)
        if size > cap:
            raise AnswerTooLarge(f"the answer is over {cap:,} bytes")
        parts.append(part)
    return b"".join(parts)
