"""The admin listener: /metrics, /healthz, /readyz and the record API, apart from the proxy port.

It is a separate listener because the proxy port is fully transparent (vLLM's own /metrics
must stay reachable through it).
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.metrics import ProxyMetrics
from proxy.record import STOP_REASONS
from proxy.store import RecordStore

MAX_LIMIT = 10_000
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload, default=str), status=status, content_type="application/json")


def _error(status: int, kind: str, message: str) -> web.Response:
    return _json({"error": {"type": kind, "message": message}}, status)


class UpstreamProbe:
    """Readiness: can the upstream be reached? Probed at most once a second, whatever the traffic."""

    def __init__(self, upstream: str, session: aiohttp.ClientSession) -> None:
        self.upstream = upstream
        self.session = session
        self._checked_at = 0.0
        self._result: tuple[bool, str] = (False, "not checked yet")

    async def check(self) -> tuple[bool, str]:
        now = time.monotonic()
        if now - self._checked_at < 1.0:
            return self._result
        self._checked_at = now
        try:
            timeout = aiohttp.ClientTimeout(total=2)
            async with self.session.get(self.upstream + "/", timeout=timeout, allow_redirects=False) as response:
                self._result = (True, f"upstream answered HTTP {response.status}")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self._result = (False, f"cannot reach the upstream {self.upstream}: {type(exc).__name__}: {exc}"[:300])
        return self._result


def build_admin_app(store: RecordStore, metrics: ProxyMetrics, probe: UpstreamProbe,
                    token: str | None = None) -> web.Application:
    @web.middleware
    async def require_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token and request.path.startswith("/api/"):
            supplied = request.headers.get("Authorization", "")
            if not hmac.compare_digest(supplied.encode(), f"Bearer {token}".encode()):
                return _error(401, "unauthorized", "this admin API needs 'Authorization: Bearer <token>'")
        return await handler(request)

    async def metrics_page(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        ok, detail = await probe.check()
        return _json({"status": "ready" if ok else "not_ready", "upstream": probe.upstream, "detail": detail},
                     200 if ok else 503)

    async def list_requests(request: web.Request) -> web.Response:
        query = request.query
        stop_reason = query.get("stop_reason") or None
        if stop_reason is not None and stop_reason not in STOP_REASONS:
            return _error(400, "bad_request",
                          f"unknown stop_reason {stop_reason!r}; one of: {', '.join(STOP_REASONS)}")
        raw_limit = query.get("limit", "100")
        if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_LIMIT:
            return _error(400, "bad_request", f"limit must be an integer from 1 to {MAX_LIMIT}")
        records = store.query(stop_reason=stop_reason, model=query.get("model") or None, limit=int(raw_limit))
        return _json({"count": len(records), "stored": len(store), "capacity": store.capacity,
                      "records": [r.to_dict() for r in records]})

    async def one_request(request: web.Request) -> web.Response:
        record = store.get(request.match_info["request_id"])
        if record is None:
            return _error(404, "not_found", "no record with that request id (it may have left the ring)")
        return _json(record.to_dict())

    app = web.Application(middlewares=[require_token])
    app.router.add_get("/metrics", metrics_page)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/api/requests", list_requests)
    app.router.add_get("/api/requests/{request_id}", one_request)
    return app
