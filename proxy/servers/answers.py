"""The answers the proxy asks a server for itself (its tokenizer, `/props`, `/v1/models`, its
`/metrics`), read whole: to their end, or to a stated cap.

`response.content.read(n)` returns what is buffered, not the whole body: an answer that comes in two
writes (any answer larger than a TCP window across a network, a vLLM `/tokenize` of a long prompt,
a 100 KB `/metrics` page) would be cut at the first. Every caller bounds the time as well
(`asyncio.timeout` around the request and the read).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from proxy.servers.base import TokenizerUnavailable
from proxy.wire.parsers import load_json


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


READ_TIMEOUT_S = 5.0
MAX_BODY_BYTES = 4 * 1024 * 1024  # what a server says of itself
MAX_COUNT_BYTES = 16 * 1024 * 1024  # a tokenizer answers with every token id: a prompt's worth


class ServerAnswers:
    """One server's answers to the proxy's own questions, on the proxy's own session: each `GET`
    read whole (or to a cap) within READ_TIMEOUT_S and kept for this round of questions (the server
    modules ask in turn, and `/v1/models` is read once for all of them); any failure is an answer
    of nothing, never an error."""

    def __init__(self, session: aiohttp.ClientSession, base: str) -> None:
        self.session = session
        self.base = base.rstrip("/")
        self._got: dict[str, Any] = {}

    async def get_json(self, path: str) -> Any:
        """The JSON of `GET path`, or None: any other status, over MAX_BODY_BYTES, not JSON, or late."""
        if path not in self._got:
            self._got[path] = await self._get(path)
        return self._got[path]

    async def _get(self, path: str) -> Any:
        try:
            async with (asyncio.timeout(READ_TIMEOUT_S),
                        self.session.get(self.base + path, allow_redirects=False) as response):
                if response.status != 200:
                    return None
                body = await read_whole(response, MAX_BODY_BYTES)
            return orjson.loads(body)
        except (aiohttp.ClientError, TimeoutError, AnswerTooLarge, orjson.JSONDecodeError, ValueError):
            return None

    async def post_json(self, path: str, payload: dict[str, Any] | bytes, headers: dict[str, str]) -> Any:
        """A tokenizer's answer to `POST path` (TokenizerUnavailable when there is none to read).
        Counting has no side effect, so a pooled connection the server closed under it (uvicorn's
        keep-alive timer, say) is tried once more on another."""
        body = payload if isinstance(payload, bytes) else orjson.dumps(payload)
        for attempt in (1, 2):
            try:
                async with self.session.post(self.base + path, data=body, headers=headers,
                                             allow_redirects=False) as response:
                    status = response.status
                    answer = await read_whole(response, MAX_COUNT_BYTES)  # however many reads it takes
                break
            except AnswerTooLarge:
                raise TokenizerUnavailable(f"POST {path}: answer over {MAX_COUNT_BYTES} bytes") from None
            except TimeoutError:
                raise TokenizerUnavailable(f"POST {path} timed out", "timeout") from None
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if attempt == 2:
                    raise TokenizerUnavailable(f"POST {path}: {type(exc).__name__}") from None
            except aiohttp.ClientError as exc:
                raise TokenizerUnavailable(f"POST {path}: {type(exc).__name__}") from None
        if status == 404:
            raise TokenizerUnavailable(f"POST {path} answered 404", "unavailable")
        if status != 200:
            raise TokenizerUnavailable(f"POST {path} answered {status}")
        try:
            return load_json(answer)
        except ValueError:
            raise TokenizerUnavailable(f"POST {path}: the answer is not JSON") from None
