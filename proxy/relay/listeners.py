"""The two listening sockets: aiohttp's server, held to what a proxy facing hostile clients needs.

- A listen backlog sized for bursts (`--backlog`): aiohttp's default of 128 resets clients when
  a thousand connect at once.
- A time limit for a whole request head (`--header-timeout`): aiohttp's keep-alive timer, which
  closes a connection that has not delivered a complete request within it, at its start and
  between keep-alive requests, so slow-header clients cannot hold connections for an hour.
- A request aiohttp's parser refuses (a header over 8190 bytes, a control byte in a value) gets
  a JSON 400 and one log line that never contains a header value, and is counted; aiohttp's own
  answer would echo the offending header, and its log would print it with a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web
from aiohttp.helpers import ceil_timeout
from aiohttp.http import StreamWriter
from aiohttp.http_exceptions import BadHttpMessage, BadStatusLine, HttpProcessingError, InvalidHeader, LineTooLong
from aiohttp.web_protocol import _PAYLOAD_ACCESS_ERROR, ERROR, RequestHandler, _ErrInfo
from aiohttp.web_request import BaseRequest

from proxy.config import HostPort

RefusalHook = Callable[[str], None]
Handler = Callable[[BaseRequest], Awaitable[web.StreamResponse]]


def refusal_reason(error: HttpProcessingError) -> str:
    """A bounded name for why a request was refused: the metric label and the log's words."""
    if isinstance(error, LineTooLong):
        return "line_too_long"
    if isinstance(error, InvalidHeader):
        return "bad_header"
    if isinstance(error, BadStatusLine):
        return "bad_request_line"
    if isinstance(error, BadHttpMessage):
        return "bad_message"
    return "bad_request"


class OneLineClientErrors(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server log, where a client's lost connection is one warning line instead of a
    traceback: a hostile client must not be able to fill the log with them."""

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        error = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if not isinstance(error, (HttpProcessingError, ConnectionError)):
            super().exception(msg, *args, exc_info=exc_info, **kwargs)
            return
        try:
            text = str(msg) % args if args else str(msg)
        except (TypeError, ValueError):
            text = str(msg)
        # The type only: a parser's message quotes the bytes it refused, and those may be a credential.
        self.warning("%s: %s", text, type(error).__name__)


SERVER_LOG = OneLineClientErrors(logging.getLogger("aiohttp.server"), {})


class OwnResponse(web.Response):
    """The proxy's own answer (when the upstream gave none, or the request could not be read): with
    a `Date`, as an origin's answer has, and no `Server` (aiohttp's would name its version)."""

    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        self.headers.popall("Server", None)


class RefusalResponse(OwnResponse):
    """The 400 for a request aiohttp's parser refused, in HTTP/1.1 and saying `Connection: close`.
    aiohttp answers through a stand-in request of version 1.0 (it could not read the client's), so
    its answer went out as `HTTP/1.0 400`, to clients that spoke 1.1; a server answers in the
    highest version it speaks whose major is the client's (RFC 9110 section 6.2), as nginx does."""

    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        self.headers["Connection"] = "close"

    async def _write_headers(self) -> None:
        writer = self._payload_writer
        assert writer is not None
        await writer.write_headers(f"HTTP/1.1 {self.status} {self.reason}", self.headers)
        if self._send_headers_immediately:
            writer.send_headers()


class GuardedRequestHandler(RequestHandler):
    """aiohttp's connection handler, answering a malformed request with a clean JSON 400, and
    running each request's handler in the connection's own task on Python 3.11 (`start`)."""

    __slots__ = ()

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status != 400 or not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        reason = refusal_reason(exc)
        self.logger.warning("refused a request that is not valid HTTP from %s: %s (HTTP 400)", request.remote, reason)
        hook: RefusalHook | None = getattr(self._manager, "on_refused", None)
        if hook is not None:
            hook(reason)
        body = orjson.dumps({"error": {"type": "bad_request", "message": f"the request is not valid HTTP "
                                       f"({reason.replace('_', ' ')})", "source": "llm-diag-proxy"}})
        response = RefusalResponse(status=400, body=body, content_type="application/json")
        response.force_close()
        return response

    if sys.version_info < (3, 12):
        async def start(self) -> None:
            """aiohttp 3.14's `RequestHandler.start`, line for line, but for one change: the request's
            handler is awaited in this task instead of in a task of its own.

            aiohttp starts that task eagerly from Python 3.12 on (its first step runs at once); on
            3.11 it waits for a turn of the loop, and its end for another before this task goes on.
            At one event per write that is a turn where a burst of other streams' reads runs first,
            and a task made and dropped per request: side by side (`benchmarks/side_by_side.py`)
            2-2.4 % less CPU per event (the first token no different). aiohttp's task is there
            to give the handler a copy of the context variables (aiohttp #3406); the proxy's handler
            sets none. The handler still runs as `request.task`, this task, as before; a lost
            connection cancels it the same way. tests/relay/test_aiohttp_contract.py fails when
            aiohttp's `start` changes: read the new one against this copy before raising the pin."""
            loop = self._loop
            manager = self._manager
            assert manager is not None
            keepalive_timeout = self._keepalive_timeout
            resp = None
            assert self._request_factory is not None
            assert self._request_handler is not None

            while not self._force_close:
                if not self._messages:
                    try:
                        # wait for next request
                        self._waiter = loop.create_future()
                        await self._waiter
                    finally:
                        self._waiter = None

                message, payload = self._messages.popleft()

                # Free a parser slot; resume reading once drained to low water so
                # pipelining keeps flowing while this request is handled.
                if self._parser is not None:
                    self._parser.message_consumed()
                if self._buffer_paused and len(self._messages) <= self._msg_queue_resume_size:
                    self._resume_reading_if_drained()

                # time is only fetched if logging is enabled as otherwise
                # its thrown away and never used.
                start = loop.time() if self._logging_enabled else None

                manager.requests_count += 1
                writer = StreamWriter(self, loop)
                if isinstance(message, _ErrInfo):
                    # make request_factory work
                    request_handler = self._make_error_handler(message)
                    message = ERROR
                else:
                    request_handler = self._request_handler

                # Important don't hold a reference to the current task
                # as on traceback it will prevent the task from being
                # collected and will cause a memory leak.
                request = self._request_factory(
                    message, payload, self, writer,
                    self._task_handler or asyncio.current_task(loop),  # type: ignore[arg-type]
                )
                try:
                    try:  # (aiohttp: `task = loop.create_task(coro)`, then `await task`)
                        resp, reset = await self._handle_request(request, start, request_handler)
                    except ConnectionError:
                        self.log_debug("Ignored premature client disconnection")
                        break

                    if reset:
                        self.log_debug("Ignored premature client disconnection 2")
                        break

                    # notify server about keep-alive
                    self._keepalive = bool(resp.keep_alive)

                    # check payload
                    if not payload.is_eof():
                        lingering_time = self._lingering_time
                        if not self._force_close and lingering_time:
                            self.log_debug("Start lingering close timer for %s sec.", lingering_time)

                            now = loop.time()
                            end_t = now + lingering_time

                            try:
                                while not payload.is_eof() and now < end_t:
                                    async with ceil_timeout(end_t - now):
                                        # read and ignore
                                        await payload.readany()
                                    now = loop.time()
                            except (TimeoutError, asyncio.CancelledError):
                                if (t := asyncio.current_task()) and t.cancelling():
                                    raise

                        # if payload still uncompleted
                        if not payload.is_eof() and not self._force_close:
                            self.log_debug("Uncompleted request.")
                            self.close()

                    payload.set_exception(_PAYLOAD_ACCESS_ERROR)

                except asyncio.CancelledError:
                    self.log_debug("Ignored premature client disconnection")
                    self.force_close()
                    raise
                except Exception as exc:
                    self.log_exception("Unhandled exception", exc_info=exc)
                    self.force_close()
                except BaseException:
                    self.force_close()
                    raise
                finally:
                    request._task = None  # type: ignore[assignment] # Break reference cycle in case of exception
                    if self.transport is None and resp is not None:
                        self.log_debug("Ignored premature client disconnection.")

                if self._keepalive and not self._close and not self._force_close:
                    # start keep-alive timer
                    close_time = loop.time() + keepalive_timeout
                    self._next_keepalive_close_time = close_time
                    if self._keepalive_handle is None:
                        self._keepalive_handle = loop.call_at(close_time, self._process_keepalive)
                else:
                    break

            # remove handler, close transport if no handlers left
            if not self._force_close:
                self._task_handler = None
                if self.transport is not None:
                    self.transport.close()


class GuardedServer(web.Server):
    """aiohttp's Server, making GuardedRequestHandlers; `on_refused` is told each refusal's reason."""

    on_refused: RefusalHook | None = None

    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(self, loop=self._loop, **self._kwargs)


class GuardedRunner(web.AppRunner):
    """An AppRunner whose server is a GuardedServer."""

    def __init__(self, app: web.Application, *, on_refused: RefusalHook | None = None, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._on_refused = on_refused

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = GuardedServer  # same layout: aiohttp's Server has no slots
        server.on_refused = self._on_refused  # type: ignore[attr-defined]
        return server


def _bare_runner(handler: Handler, on_refused: RefusalHook | None, shutdown_timeout: float = 60.0,
                 **server_options: Any) -> web.ServerRunner:
    """aiohttp's low-level server around one handler: no router, no application, no middlewares.
    The proxy port routes every request to the forwarder, and aiohttp's router and application
    cost a tenth of the proxy's CPU per request to say so."""
    server = GuardedServer(handler, **server_options)
    server.on_refused = on_refused
    return web.ServerRunner(server, shutdown_timeout=shutdown_timeout)


async def listen(target: web.Application | Handler, where: HostPort, *, backlog: int, header_timeout_s: float,
                 on_refused: RefusalHook | None = None, reuse_port: bool = False,
                 **runner_options: Any) -> tuple[web.BaseRunner, web.TCPSite, str]:
    """Start `target` (an application, or one handler for every request) on `where` (port 0: a
    free one); returns the runner, the site and the URL. `reuse_port`: SO_REUSEPORT, so that
    worker processes share the port (the kernel spreads connections over them)."""
    options: dict[str, Any] = {"access_log": None, "logger": SERVER_LOG, "keepalive_timeout": header_timeout_s,
                               **runner_options}
    runner: web.BaseRunner
    if isinstance(target, web.Application):
        runner = GuardedRunner(target, on_refused=on_refused, **options)
    else:
        runner = _bare_runner(target, on_refused, **options)
    await runner.setup()
    site = web.TCPSite(runner, where.host, where.port, reuse_address=True, reuse_port=reuse_port or None,
                       backlog=backlog)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    server: Any = site._server
    port = server.sockets[0].getsockname()[1]
    host = f"[{where.host}]" if ":" in where.host else where.host
    return runner, site, f"http://{host}:{port}"
