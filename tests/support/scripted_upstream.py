"""A scripted upstream for the proxy's tests: a real aiohttp server on loopback that answers
each request with exactly the bytes, pauses and endings a test asks for, and remembers what
it received and whether the client (the proxy) went away."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict


@dataclass
class Script:
    """One response: status, headers, body chunks (each sent and flushed on its own)."""

    chunks: Sequence[bytes] = ()
    status: int = 200
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "text/event-stream"})
    delay: float = 0.0  # seconds before each chunk
    first_delay: float = 0.0  # seconds before the headers
    end: str = "eof"  # eof | reset (close without a clean end) | hang (never end)
    content_length: bool = False  # send Content-Length instead of chunked encoding
    method: str | None = None  # answer only a request with this method (None: any)


@dataclass
class Seen:
    method: str
    path: str
    headers: CIMultiDict[str]  # as the upstream's parser read them: found whatever the spelling
    body: bytes
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)


class ScriptedUpstream:
    """Answers requests from a queue of scripts (the default script when the queue is empty)."""

    def __init__(self) -> None:
        self.scripts: list[Script] = []
        self.default = Script(chunks=[b'{"ok": true}'], headers={"Content-Type": "application/json"},
                              content_length=True)
        self.seen: list[Seen] = []
        self.server: TestServer | None = None

    def push(self, *scripts: Script) -> None:
        self.scripts.extend(scripts)

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    async def start(self) -> None:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()  # TestServer cancels handlers on disconnect

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        seen = Seen(request.method, request.path_qs, CIMultiDict(request.headers), await request.read())
        self.seen.append(seen)
        index = next((i for i, s in enumerate(self.scripts) if s.method in (None, request.method)), None)
        script = self.scripts.pop(index) if index is not None else self.default
        try:
            return await self._play(request, script)
        except (asyncio.CancelledError, ConnectionError):
            seen.disconnected.set()
            raise

    async def _play(self, request: web.Request, script: Script) -> web.StreamResponse:
        if script.first_delay:
            await asyncio.sleep(script.first_delay)
        response = web.StreamResponse(status=script.status, headers=script.headers)
        if script.content_length:
            response.content_length = sum(len(c) for c in script.chunks)
        await response.prepare(request)
        for chunk in script.chunks:
            if script.delay:
                await asyncio.sleep(script.delay)
            await response.write(chunk)
        if script.end == "hang":
            await asyncio.Event().wait()
        if script.end == "reset":
            assert request.transport is not None
            request.transport.close()
            return response
        await response.write_eof()
        return response
