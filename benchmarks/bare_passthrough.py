"""The floor of any aiohttp-based proxy: a pass-through with a pooled client and nothing else.

No parsing, no record, no metrics, no logs: what `overhead.py --targets direct,proxy,bare` measures beside
the proxy, to tell the cost of the stack from the cost of the diagnosis. Not a product.

    python benchmarks/bare_passthrough.py --upstream http://127.0.0.1:11434 --listen 127.0.0.1:8080
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web

_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host", "te",
                         "upgrade", "proxy-connection"})


def build(upstream: str) -> web.Application:
    app = web.Application()
    sessions: list[aiohttp.ClientSession] = []

    async def open_session(_: web.Application) -> None:
        sessions.append(aiohttp.ClientSession(auto_decompress=False, connector=aiohttp.TCPConnector(limit=0)))

    async def close_session(_: web.Application) -> None:
        await sessions[0].close()

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {name: value for name, value in request.headers.items()  # the benchmark's X-Bench-* too
                   if name.lower() not in _HOP_BY_HOP}
        async with sessions[0].request(request.method, upstream + request.rel_url.raw_path_qs, data=body,
                                       headers=headers) as upstream_response:
            response = web.StreamResponse(status=upstream_response.status, headers={
                "Content-Type": upstream_response.headers.get("Content-Type", "")})
            await response.prepare(request)
            async for chunk in upstream_response.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_route("*", "/{tail:.*}", relay)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--listen", required=True, help="HOST:PORT")
    args, _ = parser.parse_known_args()  # the proxy's own flags are accepted and ignored
    host, _, port = args.listen.rpartition(":")
    import uvloop

    uvloop.install()
    web.run_app(build(args.upstream.rstrip("/")), host=host, port=int(port), print=None, access_log=None)


if __name__ == "__main__":
    main()
