"""The admin listener: /metrics, /healthz, /readyz and the record API, apart from the proxy port.

It is a separate listener because the proxy port is fully transparent (vLLM's own /metrics
must stay reachable through it). No admin read holds the event loop (and the live streams on
it) for more than a few milliseconds: history pages and `/api/diagnose` run in a reader process
of their own (proxy.serve.admin_reads), one at a time with a bounded queue; pages of the in-memory ring
are found in a thread over a copy and written in small batches, each serialised on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

import aiohttp
import orjson
import structlog
from aiohttp import web
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from proxy.config import parse_duration
from proxy.observers.history import HistoryError, HistorySource
from proxy.observers.record_store import DEFAULT_PAGE, MAX_PAGE, RecordQuery
from proxy.record import CAUSES, CONCURRENCY_BUCKETS, OUTCOMES, STOP_REASONS, LengthCause, ResponseRecord
from proxy.relay.admission import AdmissionGate, GateSettings
from proxy.serve.admin_reads import AdminBusy, AdminReaders, AdminReadFailed
from proxy.serve.messages import PageFound
from proxy.serve.trace_receiver import receiver_off
from proxy.sweep.live import BY

_log = structlog.get_logger("llm_diag_proxy")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
TRACES = "/v1/traces"  # where a server sends its request spans (OTLP/HTTP's path)
LENGTH_CAUSES: tuple[str, ...] = LengthCause.__args__  # type: ignore[attr-defined]


def _json(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload, default=str), status=status, content_type="application/json")


def _error(status: int, kind: str, message: str) -> web.Response:
    return _json({"error": {"type": kind, "message": message}}, status)


class BadQuery(ValueError):
    """A query parameter that cannot be used; its message goes back in a 400."""


def _busy(exc: AdminBusy) -> web.Response:
    response = _error(503, "admin_busy", str(exc))
    response.headers["Retry-After"] = "1"
    return response


def _read_failed(exc: AdminReadFailed) -> web.Response:
    return _error(503, exc.kind if exc.kind != "error" else "admin_read_failed", str(exc))


def parse_time(name: str, value: str) -> float:
    """Unix seconds, ISO 8601 (`2026-12-03T10:00:00Z`; without a zone: UTC), or an age back from
    now as `diagnose --since` takes it (`90s`, `30m`, `1h`, `7d`, `2w`)."""
    try:
        number = float(value)
    except ValueError:
        pass
    else:
        if not math.isfinite(number):
            raise BadQuery(f"{name} must be a finite time, got {value[:40]!r}")
        return number
    if value[-1:].lower() in "smhdw" and value[:-1].replace(".", "", 1).isdigit() and len(value) <= 20:
        return time.time() - parse_duration(value)
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise BadQuery(f"{name} must be unix seconds, ISO 8601 or an age (1h, 30m, 7d), got {value[:40]!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def _choice(query: dict[str, str], name: str, allowed: Sequence[str]) -> str | None:
    value = query.get(name) or None
    if value is not None and value not in allowed:
        raise BadQuery(f"unknown {name} {value[:60]!r}; one of: {', '.join(allowed)}")
    return value


MAX_CURSOR = (1 << 63) - 1  # a cursor is a SQLite rowid: a signed 64-bit integer


def bounded_int(text: str, low: int, high: int) -> int | None:
    """`text` as an integer from `low` to `high`, else None; digits are counted before they are
    converted, so a 5,000-digit number costs nothing (and meets no conversion limit)."""
    text = text.strip()
    if not text.isascii() or not text.isdigit() or len(text) > len(str(high)):
        return None
    number = int(text)
    return number if low <= number <= high else None


def record_query(query: dict[str, str]) -> RecordQuery:
    """The query parameters of GET /api/requests; raises BadQuery."""
    limit = bounded_int(query.get("limit", str(DEFAULT_PAGE)), 1, MAX_PAGE)
    if limit is None:
        raise BadQuery(f"limit must be an integer from 1 to {MAX_PAGE}")
    raw_cursor = query.get("cursor")
    cursor = bounded_int(raw_cursor, 0, MAX_CURSOR) if raw_cursor is not None else None
    if raw_cursor is not None and cursor is None:
        raise BadQuery("cursor must be the next_cursor of an earlier page")
    return RecordQuery(
        stop_reason=_choice(query, "stop_reason", STOP_REASONS),
        length_cause=_choice(query, "length_cause", LENGTH_CAUSES),
        cause=_choice(query, "cause", CAUSES), outcome=_choice(query, "outcome", OUTCOMES),
        concurrency=_choice(query, "concurrency", CONCURRENCY_BUCKETS),
        model=query.get("model") or None, route=query.get("route") or None,
        instance=query.get("instance") or None, upstream=query.get("upstream") or None,
        client=query.get("client") or None,
        since=parse_time("since", query["since"]) if query.get("since") else None,
        until=parse_time("until", query["until"]) if query.get("until") else None,
        cursor=cursor, limit=limit)


class RecordSource(Protocol):
    """The records the admin listener reads: one serving process's (`proxy.serve.process.LocalRecords`),
    or every worker's (`proxy.serve.workers.WorkerRecords`). Each read sees every record of an answer
    that ended before it: what waits for its batch is delivered first."""

    @property
    def history_source(self) -> HistorySource | None:
        """Where the history is read; None when none is kept."""
        ...

    async def settle(self) -> bool | None:
        """Deliver what waits, and let the history write what it was handed; whether the history
        is up (None: none is kept)."""
        ...

    async def page(self, query: RecordQuery) -> PageFound:
        """A page of the in-memory records."""
        ...

    async def get(self, request_id: str) -> bytes | None:
        """One record's JSON, by the proxy's request id or the upstream's own."""
        ...

    async def ring(self, query: RecordQuery) -> list[bytes]:
        """Every matching in-memory record, as JSON arrays."""
        ...

    async def refresh_metrics(self) -> None:
        """Bring the metrics up to every record delivered."""
        ...


class UpstreamReachability:
    """Can the upstream be reached? Said by /readyz; tried at most once a second, whatever the traffic
    (a TCP connection and a `GET /`, on the proxy's own session, never through its port)."""

    def __init__(self, upstream: str, session: aiohttp.ClientSession, authorization: str | None = None) -> None:
        self.upstream = upstream
        self.session = session
        self._headers = {"Authorization": authorization} if authorization else {}
        self._checked_at = 0.0
        self._result: tuple[bool, str] = (False, "not checked yet")

    async def reachable(self) -> tuple[bool, str]:
        now = time.monotonic()
        if now - self._checked_at < 1.0:
            return self._result
        self._checked_at = now
        try:
            timeout = aiohttp.ClientTimeout(total=2)
            async with self.session.get(self.upstream + "/", timeout=timeout, allow_redirects=False,
                                        headers=self._headers) as response:
                self._result = (True, f"upstream answered HTTP {response.status}")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self._result = (False, f"cannot reach the upstream {self.upstream}: {type(exc).__name__}: {exc}"[:300])
        return self._result


def bearer_matches(header: str, token: str) -> bool:
    """`Authorization: Bearer TOKEN`, the scheme in any case (RFC 9110 section 11.1); any bytes."""
    scheme, _, credentials = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    supplied = credentials.strip().encode("utf-8", "surrogateescape")
    return hmac.compare_digest(supplied, token.encode("utf-8", "surrogateescape"))


SESSION_COOKIE = "llm_diag_admin"
SESSION_TTL_S = 12 * 3600


class Sessions:
    """The page's session cookies: `EXPIRY.SIGNATURE`, an HMAC of the expiry and the admin token under a
    key drawn anew by each start of the proxy. A cookie never holds the token; it expires after
    SESSION_TTL_S; a restart, or a new token, revokes every one."""

    def __init__(self, token: str, ttl_s: float = SESSION_TTL_S, clock: Callable[[], float] = time.time) -> None:
        self._key = secrets.token_bytes(32)
        self._token = token.encode("utf-8", "surrogateescape")
        self.ttl_s = ttl_s
        self._clock = clock

    def _signature(self, expiry: int) -> str:
        return hmac.new(self._key, b"%d:" % expiry + self._token, "sha256").hexdigest()

    def issue(self) -> str:
        expiry = int(self._clock() + self.ttl_s)
        return f"{expiry}.{self._signature(expiry)}"

    def valid(self, value: str) -> bool:
        expiry_text, _, signature = value.partition(".")
        expiry = bounded_int(expiry_text, 0, 1 << 40)
        if expiry is None or expiry < self._clock():
            return False
        return hmac.compare_digest(signature.encode("ascii", "replace"), self._signature(expiry).encode())


def allowed_host(host: str, names: frozenset[str]) -> bool:
    """A `Host` a browser may send to the admin page without DNS rebinding behind it: an IP address
    (what the listener binds), `localhost`, or a name the operator allowed (`--admin-allowed-hosts`;
    `*` allows any)."""
    if "*" in names:
        return True
    name = host.strip().lower()
    if name.startswith("["):
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    if name in names or name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def build_admin_app(records: RecordSource, registry: CollectorRegistry, upstream: UpstreamReachability,
                    token: str | None = None, ready: Callable[[], bool] = lambda: True,
                    allowed_hosts: frozenset[str] = frozenset(),
                    readers: AdminReaders | None = None, instance: str | None = None,
                    about: Callable[[], dict[str, Any]] | None = None,
                    traces: Handler | None = None, admission: AdmissionGate | None = None) -> web.Application:
    """`records`: what is read (every answer that has ended is in it); `registry`: what /metrics
    says, once `records` brought it up to date; `about`: the proxy's own addresses and what its
    upstream says of itself (`GET /api/about`); `traces`: the receiver of the server's request spans
    (`POST /v1/traces`, `--server-traces on`)."""
    sessions = Sessions(token) if token else None
    readers = readers or AdminReaders()
    history_source = records.history_source

    @web.middleware
    async def check_host(request: web.Request, handler: Handler) -> web.StreamResponse:
        """The page and the record API answer only a `Host` that is no stranger's name: a web page
        that rebinds its own name to 127.0.0.1 finds nothing (the scrape and the probes stay open)."""
        if (request.path.startswith("/api/") or request.path in ("/", TRACES)) and not allowed_host(request.host,
                                                                                                   allowed_hosts):
            return _error(403, "forbidden_host", "this Host is not one the admin listener answers; add it with "
                                                 "--admin-allowed-hosts")
        return await handler(request)

    @web.middleware
    async def require_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        """`/api/*` and the page `/` need the token: as a bearer header, or (for a browser) the cookie
        the page sets after it was opened once as `/?token=TOKEN`."""
        if not token or sessions is None or not (request.path.startswith("/api/") or request.path in ("/", TRACES)):
            return await handler(request)
        cookie = request.cookies.get(SESSION_COOKIE, "")
        if bearer_matches(request.headers.get("Authorization", ""), token) or sessions.valid(cookie):
            return await handler(request)
        given = request.query.get("token")
        if request.path == "/" and given is not None and hmac.compare_digest(
                given.encode("utf-8", "surrogateescape"), token.encode("utf-8", "surrogateescape")):
            found = web.Response(status=302, headers={"Location": "/"})  # the token leaves the address bar
            found.set_cookie(SESSION_COOKIE, sessions.issue(), httponly=True, samesite="Strict", path="/",
                             max_age=int(sessions.ttl_s))
            return found
        if request.path == "/":
            return web.Response(status=401, content_type="text/plain",
                                text="This page needs the admin token: open /?token=<token> once (a cookie "
                                     "keeps you in), or send 'Authorization: Bearer <token>'.\n")
        return _error(401, "unauthorized", "this admin API needs 'Authorization: Bearer <token>'")

    async def page(request: web.Request) -> web.Response:
        from proxy.serve import admin_page

        choices = {"stop_reason": list(STOP_REASONS), "cause": list(CAUSES), "outcome": list(OUTCOMES),
                   "concurrency": list(CONCURRENCY_BUCKETS)}
        return web.Response(body=admin_page.render(choices), content_type="text/html",
                            headers={"Cache-Control": "no-store", "X-Frame-Options": "DENY",
                                     "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; "
                                                                "style-src 'unsafe-inline'; img-src 'self' data:"})

    async def answer(request: web.Request, body: bytes) -> web.StreamResponse:
        """A JSON body read elsewhere, written while it counts against the bound on admin answers."""
        try:
            with readers.answering_with(len(body)):
                response = web.StreamResponse(headers={"Content-Type": "application/json"})
                response.content_length = len(body)
                await response.prepare(request)
                await response.write(body)
                await response.write_eof()
                return response
        except AdminBusy as exc:
            return _busy(exc)

    async def read(request: web.Request, name: str, *args: object,
                   blobs: Callable[[], Awaitable[list[bytes]]] | None = None) -> web.StreamResponse | AdminReadFailed:
        """A reader's answer written out, a 503 when the readers are busy, or why the read failed."""
        try:
            body = await readers.run(name, *args, blobs=blobs)
        except AdminBusy as exc:
            return _busy(exc)
        except AdminReadFailed as exc:
            if exc.kind == "history":
                _log.warning("history_read_failed", error=str(exc))  # the ring still answers; say so
            return exc
        return await answer(request, body)

    async def diagnose(request: web.Request) -> web.StreamResponse:
        """The live verdict (`llm-diag-proxy diagnose`) of the last `since` seconds, as JSON, worked
        out in the verdicts reader from the history (else from the ring, sent there in batches)."""
        try:
            seconds = float(request.query.get("since", "3600"))
            min_per_level = int(request.query.get("min_per_level", "5"))
        except ValueError:
            return _error(400, "bad_request", "since is seconds, min_per_level an integer")
        if not (0 < seconds <= 366 * 86400 and 1 <= min_per_level <= 1000):
            return _error(400, "bad_request", "since must be 0 to a year of seconds, min_per_level 1 to 1000")
        by = request.query.get("by") or None
        if by is not None and by not in BY:
            return _error(400, "bad_request", f"by is one of {', '.join(BY)}")
        since = time.time() - seconds
        # The sweep it suggests goes through this proxy's own port, joined by this admin listener.
        addresses = (about() if about is not None else {}).get("proxy", {})
        admin = f"{request.scheme}://{request.host}"
        target = addresses.get("url") or "http://127.0.0.1:8080"
        asked = request.query.get("instance") or None
        if history_source is not None and await records.settle():
            # A fleet's shared history holds every replica's records, and a verdict mixes none of
            # them: by default it is this proxy's own; `by=instance` judges each and names the one
            # that differs.
            shared = history_source.postgres and by is None and asked is None
            query = RecordQuery(since=since, instance=instance if shared else asked)
            done = await read(request, "diagnose", history_source, query, min_per_level, target, admin, by)
            if not isinstance(done, AdminReadFailed):
                return done
            if done.kind != "history":
                return _read_failed(done)

        query = RecordQuery(since=since, instance=asked)
        done = await read(request, "diagnose", None, query, min_per_level, target, admin, by,
                          blobs=lambda: records.ring(query))
        return _read_failed(done) if isinstance(done, AdminReadFailed) else done

    async def metrics_page(request: web.Request) -> web.Response:
        # OpenMetrics when the scraper asks for it (Prometheus does): it carries the exemplars.
        # Rendered off the event loop: thousands of lines take ~0.1 s of pure Python, which in a
        # thread yields the loop every few ms (prometheus_client locks each metric as it copies it).
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        await records.refresh_metrics()
        body = await asyncio.to_thread(encoder, registry)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def healthz(request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        """Ready while the proxy can serve: a slow or absent upstream does not make it unready (that
        would pull the only replica out of its Service while vLLM loads or stalls; upstream health
        is a metric and an alert). `?upstream=required` asks for the upstream's answer as well."""
        if not ready():
            return _json({"status": "not_ready", "upstream": upstream.upstream, "upstream_reachable": None,
                          "detail": "the proxy port is not accepting: starting, shutting down, "
                                    "or no worker alive"}, 503)
        reachable, detail = await upstream.reachable()
        strict = request.query.get("upstream") == "required"
        status = "ready" if reachable or not strict else "not_ready"
        return _json({"status": status, "upstream": upstream.upstream, "upstream_reachable": reachable,
                      "detail": detail}, 200 if status == "ready" else 503)

    async def list_requests(request: web.Request) -> web.StreamResponse:
        """A page of records: from the history in the pages reader, else from a copy of the ring
        read in a thread and serialised a batch at a time, one ring page at a time."""
        try:
            query = record_query(dict(request.query))
        except BadQuery as exc:
            return _error(400, "bad_request", str(exc))
        # Read-your-writes: the records of answers that ended before this request are written first.
        if history_source is not None and await records.settle():
            done = await read(request, "history_page", history_source, query)
            if not isinstance(done, AdminReadFailed):
                return done
            if done.kind != "history":
                return _read_failed(done)
        try:
            async with readers.memory.turn():
                page = await records.page(query)
                next_cursor = page.records[-1][0] if page.more and page.records else None
                head = {"count": len(page.records), "source": "memory", "stored": page.stored,
                        "capacity": page.capacity}
                body = (orjson.dumps(head)[:-1] + b',"records":[' + b",".join(body for _, body in page.records)
                        + b'],"next_cursor":' + orjson.dumps(next_cursor) + b"}")
        except AdminBusy as exc:
            return _busy(exc)
        return await answer(request, body)

    async def one_request(request: web.Request) -> web.Response:
        request_id = request.match_info["request_id"]
        found = await records.get(request_id)
        if found is None and history_source is not None:
            with contextlib.suppress(HistoryError):
                record = await asyncio.to_thread(_history_get, history_source, request_id)
                found = None if record is None else orjson.dumps(record.to_dict(), default=str)
        if found is None:
            return _error(404, "not_found", "no record with that request id (not in memory nor in the history)")
        return web.Response(body=found, content_type="application/json")

    async def about_page(request: web.Request) -> web.Response:
        """Where this proxy listens and what its server says of itself: what the sweep needs to
        repeat a request through the proxy without asking the server anything through it (its own
        reads would be records, metrics and, where the server answers 404, upstream errors)."""
        return _json(about() if about is not None else {})

    def gate_state() -> dict[str, Any]:
        assert admission is not None
        settings = admission.settings
        return {"max_in_flight": settings.max_in_flight, "queue_max": settings.queue_max,
                "queue_timeout_s": settings.queue_timeout_s, "in_flight": admission.in_flight,
                "waiting": admission.waiting}

    async def admission_state(request: web.Request) -> web.Response:
        """The admission gate: its settings and what it holds now."""
        if admission is None:
            return _error(404, "no_gate", "the admission gate needs one process (it is not built with --workers)")
        return _json(gate_state())

    async def admission_set(request: web.Request) -> web.Response:
        """New gate settings, at once (the sweep's second arm): `{"max_in_flight": N or null, "queue_max": N,
        "queue_timeout_s": S or null}`, each left out kept."""
        if admission is None:
            return _error(404, "no_gate", "the admission gate needs one process (it is not built with --workers)")
        try:
            asked = orjson.loads(await request.read())
            settings = gate_settings(asked, admission.settings)
        except (orjson.JSONDecodeError, BadQuery) as exc:
            return _error(400, "bad_request", f"admission settings: {exc}"[:300])
        admission.set(settings)
        _log.info("admission_changed", max_in_flight=settings.max_in_flight, queue_max=settings.queue_max,
                  queue_timeout_s=settings.queue_timeout_s)
        return _json(gate_state())

    async def no_server_version(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["Server"] = "llm-diag-proxy"  # aiohttp's own names its version

    async def close_reader(app: web.Application) -> None:
        await readers.close()

    app = web.Application(middlewares=[check_host, require_token])
    app.on_cleanup.append(close_reader)
    app.on_response_prepare.append(no_server_version)
    app.router.add_get("/", page)
    app.router.add_get("/api/diagnose", diagnose)
    app.router.add_get("/api/about", about_page)
    app.router.add_get("/metrics", metrics_page)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/api/requests", list_requests)
    app.router.add_get("/api/requests/{request_id}", one_request)
    app.router.add_post(TRACES, traces or receiver_off)
    app.router.add_get("/api/admission", admission_state)
    app.router.add_put("/api/admission", admission_set)
    return app


def gate_settings(asked: Any, now: GateSettings) -> GateSettings:
    """Settings from a PUT's body, what it leaves out kept; BadQuery for anything else."""
    if not isinstance(asked, dict) or not asked.keys() <= {"max_in_flight", "queue_max", "queue_timeout_s"}:
        raise BadQuery("an object of max_in_flight, queue_max, queue_timeout_s")
    limit = asked.get("max_in_flight", now.max_in_flight)
    queue_max = asked.get("queue_max", now.queue_max)
    timeout = asked.get("queue_timeout_s", now.queue_timeout_s)
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or not 0 < limit <= 1 << 20):
        raise BadQuery("max_in_flight: a positive integer, or null to open the gate")
    if not isinstance(queue_max, int) or isinstance(queue_max, bool) or not 0 < queue_max <= 1 << 20:
        raise BadQuery("queue_max: a positive integer")
    if timeout is not None and (not isinstance(timeout, int | float) or isinstance(timeout, bool)
                                or not 0 < timeout <= 86400):
        raise BadQuery("queue_timeout_s: seconds above 0, or null to wait as long as it takes")
    return GateSettings(limit, queue_max, None if timeout is None else float(timeout))


def _history_get(source: HistorySource, request_id: str) -> ResponseRecord | None:
    """One record of the history (in a thread: a read of its own)."""
    return source.backend().get(request_id)
