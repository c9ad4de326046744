"""A plain HTTP relay for the tests: everything to the upstream, but the paths it is told to refuse."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host"})


@contextlib.asynccontextmanager
async def blocking_relay(upstream: str, *refused: str) -> AsyncIterator[str]:
    """A relay to `upstream` that answers 403 on `refused` paths (a gateway that lets only inference
    through); yields its URL."""
    session = aiohttp.ClientSession(auto_decompress=False)

    async def relay(request: web.Request) -> web.StreamResponse:
        if request.path in refused:
            return web.json_response({"error": "forbidden by the gateway"}, status=403)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with session.request(request.method, upstream + request.path_qs, headers=headers,
                                   data=await request.read(), allow_redirects=False) as answer:
            response = web.StreamResponse(status=answer.status, headers={
                k: v for k, v in answer.headers.items() if k.lower() not in _HOP})
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", relay)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()
        await session.close()
