"""A fake upstream as a real aiohttp server on loopback: a subclass adds its routes, this starts,
names and stops the server."""

from __future__ import annotations

from aiohttp import web
from aiohttp.test_utils import TestServer


class LoopbackApp:
    """Start, URL and close of a fake upstream whose routes `add_routes` adds."""

    server: TestServer | None

    def add_routes(self, app: web.Application) -> None:
        raise NotImplementedError

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    async def start(self) -> None:
        app = web.Application()
        self.add_routes(app)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()
