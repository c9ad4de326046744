"""A fake upstream that serves, for each GET path, whatever status and body a test sets now."""

from __future__ import annotations

from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support.loopback_app import LoopbackApp


class FakeUpstream(LoopbackApp):
    """A real aiohttp server on loopback serving whatever `routes` holds now (path -> (status, body))."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, bytes]] = {}
        self.hits: list[str] = []
        self.server: TestServer | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        self.hits.append(request.path)
        status, body = self.routes.get(request.path, (404, b"404 page not found"))
        return web.Response(status=status, body=body)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_route("GET", "/{tail:.*}", self._handle)
