"""Wiring: the proxy listener, the admin listener, and the observers between them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from proxy.admin import UpstreamProbe, build_admin_app
from proxy.concurrency import InFlightTracker
from proxy.config import HostPort, ProxyConfig
from proxy.forward import Forwarder, connection_reuse_trace
from proxy.logs import LogObserver, configure_logging
from proxy.metrics import MetricsObserver, ProxyMetrics
from proxy.observers import ObserverChain
from proxy.store import RecordStore
from proxy.telemetry import Telemetry

_log = structlog.get_logger("llm_diag_proxy")
POOLED_IDLE_S = 3.0


def upstream_session(config: ProxyConfig) -> aiohttp.ClientSession:
    """The client session to the upstream: no decompression (bytes pass as sent), no cookie jar
    (clients must not share cookies), no proxy settings from the environment, no pool limit.

    Connections are pooled: a fresh one per request costs a connect and an accept on the
    critical path of every first token. A pooled connection idles at most
    POOLED_IDLE_S, less than the keep-alive timeouts of uvicorn (vLLM) and cpp-httplib
    (llama-server), 5 s each, so the proxy does not pick one the server is closing; one the
    server closed anyway (llama-server closes after every streamed response despite
    `Keep-Alive`) is sent again on another connection by the forwarder (`UpstreamAttempt`).
    """
    return aiohttp.ClientSession(
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        trust_env=False,
        timeout=aiohttp.ClientTimeout(total=None, connect=config.connect_timeout_s, sock_read=None),
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=POOLED_IDLE_S, enable_cleanup_closed=True),
        trace_configs=[connection_reuse_trace()],
    )


@dataclass
class RunningProxy:
    """A started proxy: its two listeners, its record store and metrics."""

    config: ProxyConfig
    proxy_url: str
    admin_url: str
    store: RecordStore
    metrics: ProxyMetrics
    concurrency: InFlightTracker
    observers: ObserverChain
    _runners: list[web.AppRunner] = field(default_factory=list)
    _session: aiohttp.ClientSession | None = None
    _telemetry: Telemetry | None = None

    async def close(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        if self._telemetry is not None:
            await self._telemetry.stop()
        if self._session is not None:
            await self._session.close()


class OneLineClientErrors(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server log, where a client's malformed request or lost connection is one warning
    line instead of a traceback: a hostile client must not be able to fill the log with them."""

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        error = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if not isinstance(error, (HttpProcessingError, ConnectionError)):
            super().exception(msg, *args, exc_info=exc_info, **kwargs)
            return
        try:
            text = str(msg) % args if args else str(msg)
        except (TypeError, ValueError):
            text = str(msg)
        self.warning("%s: %s: %s", text, type(error).__name__, " ".join(str(error).split())[:300])


SERVER_LOG = OneLineClientErrors(logging.getLogger("aiohttp.server"), {})


async def _listen(app: web.Application, where: HostPort, **runner_options: Any) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None, logger=SERVER_LOG, **runner_options)
    await runner.setup()
    site = web.TCPSite(runner, where.host, where.port, reuse_address=True)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    server: Any = site._server
    port = server.sockets[0].getsockname()[1]
    host = f"[{where.host}]" if ":" in where.host else where.host
    return runner, f"http://{host}:{port}"


async def start_proxy(config: ProxyConfig, *, extra_observers: tuple[object, ...] = (),
                      log_records: bool | None = None) -> RunningProxy:
    """Start both listeners (port 0 picks a free port) and return once they accept connections."""
    metrics = ProxyMetrics(max_models=config.max_models)
    store = RecordStore(config.ring_size)
    telemetry = Telemetry(config, metrics)
    chain = ObserverChain()
    chain.add(telemetry.observer)  # enrichers first: what they add is exported below
    for observer in extra_observers:
        chain.add(observer)
    chain.add(MetricsObserver(metrics))
    if config.log_records if log_records is None else log_records:
        chain.add(LogObserver(config.upstream))
    chain.add(store)
    session = upstream_session(config)
    concurrency = InFlightTracker()
    metrics.in_flight.set_function(lambda: concurrency.in_flight)
    forwarder = Forwarder(config, session, chain, concurrency)
    proxy_app = web.Application(client_max_size=config.request_body_cap_bytes)
    proxy_app.router.add_route("*", "/{tail:.*}", forwarder.handle)
    admin_app = build_admin_app(store, metrics, UpstreamProbe(config.upstream, session), config.admin_token)
    running = RunningProxy(config, "", "", store, metrics, concurrency, chain, _session=session,
                           _telemetry=telemetry)
    try:
        # handler_cancellation: a client that goes away cancels its handler at once, so the
        # upstream request is cancelled too (the server frees the sequence's KV blocks).
        runner, running.proxy_url = await _listen(proxy_app, config.listen, handler_cancellation=True)
        running._runners.append(runner)
        runner, running.admin_url = await _listen(admin_app, config.admin_listen)
        running._runners.append(runner)
        await telemetry.start()
    except BaseException:
        await running.close()
        raise
    return running


def serve_forever(config: ProxyConfig) -> int:
    """Run the proxy until SIGINT/SIGTERM; returns the exit code."""
    configure_logging(config.log_level, config.log_format)
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # uvloop is not built for every platform
        runner = asyncio.run
    try:
        return int(runner(_serve(config)))
    except KeyboardInterrupt:
        return 0


async def _serve(config: ProxyConfig) -> int:
    try:
        running = await start_proxy(config)
    except OSError as exc:
        print(f"llm-diag-proxy: error: cannot listen: {exc.strerror or exc}", file=sys.stderr)
        return 2
    _log.info("listening", proxy=running.proxy_url, admin=running.admin_url, upstream=config.upstream,
              deadline_s=config.deadline_s, idle_timeout_s=config.idle_timeout_s,
              deadline_mode=config.deadline_mode)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        _log.info("stopping")
        await running.close()
    return 0
