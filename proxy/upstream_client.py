"""The client side of the forwarding path: the pooled session to the upstream.

Connections are pooled: a fresh one per request costs a connect and an accept on the critical
path of every first token. A pooled connection idles at most POOLED_IDLE_S, less than the
keep-alive timeouts of uvicorn (vLLM) and cpp-httplib (llama-server), 5 s each. A server may still
close one while it sits in the pool: before a pooled connection carries a request, the connector
looks whether the server has closed it, and opens a fresh one instead, so a request is never
written into a closed socket and never has to be sent twice.

Nor is the pool's clock the server's: aiohttp dates a connection from when it released it, when
the response's end had been read out of its buffers, which on a busy loop or behind a slow client
can be seconds after the server sent it; the server's keep-alive timer runs from its last byte. So
a pooled connection is also passed over when the kernel says the server's last byte came more
than POOLED_IDLE_S ago (TCP_INFO's tcpi_last_data_recv, on Linux).

That look cannot see a close still on its way. llama-server closes its connection after every
streamed response despite `Keep-Alive`, a few milliseconds after the last byte: a request taken
from the pool in between (the next one of a client that asks right after an answer) would be
written into a socket the server is closing, and be lost. So a connection that carried a
streamed answer rests SETTLE_S in the pool before it is used again; a request in that time gets
another connection or a fresh one.
"""

from __future__ import annotations

import inspect
import select
import socket
import struct
import time
import weakref
from types import SimpleNamespace
from typing import Any

import aiohttp
import structlog

from proxy.config import ProxyConfig

_log = structlog.get_logger("llm_diag_proxy")
POOLED_IDLE_S = 3.0
# llama-server's close came 1-2 ms after the last byte of a stream on an idle machine (a request
# sent into that window got no answer in 11 of 100 tries); a wide margin for a loaded one.
SETTLE_S = 0.25


def _socket_of(connection: aiohttp.connector.Connection) -> Any:
    """The connection's socket, or None when it has none (closed)."""
    protocol = connection.protocol
    transport = protocol.transport if protocol is not None else None
    return transport.get_extra_info("socket") if transport is not None else None


# struct tcp_info (linux/tcp.h): tcpi_last_data_recv, milliseconds since the kernel last received
# data on the socket, is the eighth __u32 after the eight one-byte fields.
_TCP_INFO = getattr(socket, "TCP_INFO", None)
_LAST_DATA_RECV = struct.Struct("=I")
_LAST_DATA_RECV_AT = 52


def quiet_for(connection: aiohttp.connector.Connection) -> float | None:
    """Seconds since the server's last byte reached this machine's kernel on the connection, or
    None where the kernel does not say (not Linux, no socket).

    The pool's own clock starts when aiohttp releases a connection, which it does when the
    response's end has been read out of its buffers: on a busy event loop, or behind a slow
    client, that can be seconds after the server sent it. The server's keep-alive timer (uvicorn's
    5 s in vLLM) started at its last byte, and so does this figure."""
    sock = _socket_of(connection)
    return None if sock is None else _quiet(sock)


def _quiet(sock: Any) -> float | None:
    if _TCP_INFO is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _LAST_DATA_RECV_AT + 4)
    except OSError:
        return None
    if len(info) < _LAST_DATA_RECV_AT + 4:
        return None
    return float(_LAST_DATA_RECV.unpack_from(info, _LAST_DATA_RECV_AT)[0]) / 1000.0


def _reusable(connection: aiohttp.connector.Connection) -> bool:
    """Neither closed by the server nor quiet too long (`quiet_for`), from one lookup of the socket.

    Closed: an idle HTTP/1.1 connection has nothing to read, so a readable socket means a FIN, a
    reset, or bytes that belong to no request. One poll(2) with no wait, on its own descriptor.
    """
    sock = _socket_of(connection)
    if sock is None:
        return True  # no transport: aiohttp's own checks have it
    quiet = _quiet(sock)
    return (quiet is None or quiet <= POOLED_IDLE_S) and not readable(sock.fileno())


def readable(fd: int) -> bool:
    """The descriptor has something to read (data, a FIN, an error) right now."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))


class LivenessCheckedConnector(aiohttp.TCPConnector):
    """A TCPConnector that never hands out a pooled connection the server has already closed,
    nor, for SETTLE_S after it was released, one that carried a streamed answer."""

    stale_closed = 0  # pooled connections found closed by the server, process-wide

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._streamed: weakref.WeakSet[object] = weakref.WeakSet()  # protocols whose answer streamed

    def streamed(self, response: aiohttp.ClientResponse) -> None:
        """This answer has no length (a stream): its connection rests before it is used again.

        A short stream may have ended, and its connection gone back to the pool, before the
        response reached the caller; aiohttp's response keeps its protocol (`_protocol`) for that.
        """
        protocol = getattr(response, "_protocol", None)  # (a protocol is a queue: empty, it is falsy)
        if protocol is None and response.connection is not None:
            protocol = response.connection.protocol
        if protocol is not None:
            self._streamed.add(protocol)

    async def _get(self, key: Any, traces: Any) -> Any:  # aiohttp >= 3.11: (key, traces), async
        resting: list[tuple[Any, float]] = []
        try:
            while True:
                self._take_resting(key, resting)
                connection = await super()._get(key, traces)
                if connection is None:
                    return None
                if _reusable(connection):
                    self._streamed.discard(connection.protocol)
                    return connection
                LivenessCheckedConnector.stale_closed += 1
                connection.close()
        finally:
            if resting:  # back at the head of the pool, in their order
                self._conns[key].extendleft(reversed(resting))

    def _take_resting(self, key: Any, resting: list[tuple[Any, float]]) -> None:
        """Set aside, for one lookup, the streamed connections at the head of the pool that were
        released under SETTLE_S ago. aiohttp takes the oldest first and the pool is in release
        order, so this looks at the head only: one comparison while the pool's oldest has settled."""
        conns = self._conns.get(key)
        if not conns or not self._streamed:
            return
        now = time.monotonic()
        while conns:
            protocol, released = conns[0]
            if now - released >= SETTLE_S or protocol not in self._streamed:
                return
            resting.append(conns.popleft())
        del self._conns[key]  # aiohttp drops an empty key; the finally above restores it


def streamed(session: aiohttp.ClientSession, response: aiohttp.ClientResponse) -> None:
    """Tell the pool that `response` streams (see SETTLE_S)."""
    connector = session.connector
    if isinstance(connector, LivenessCheckedConnector):
        connector.streamed(response)


def _liveness_hook_fits() -> bool:
    """The check overrides a private method of aiohttp: only where its shape is the one written for."""
    method = getattr(aiohttp.TCPConnector, "_get", None)
    if method is None or not inspect.iscoroutinefunction(method):
        return False
    return list(inspect.signature(method).parameters) == ["self", "key", "traces"]


# The methods aiohttp sends again on a fresh connection when a pooled one dies under them
# (aiohttp.client.IDEMPOTENT_METHODS).
SENT_AGAIN = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})


class SendCount:
    """How many times aiohttp sent one request: it sends an idempotent request (GET, PUT, ...) once
    more when a pooled connection dies under it (RFC 9112 section 9.3.1), never a POST."""

    __slots__ = ("sends",)

    def __init__(self) -> None:
        self.sends = 0

    @property
    def retries(self) -> int:
        return max(0, self.sends - 1)


async def _count_send(_session: aiohttp.ClientSession, context: SimpleNamespace,
                      _params: aiohttp.TraceRequestHeadersSentParams) -> None:
    count = context.trace_request_ctx
    if isinstance(count, SendCount):
        count.sends += 1


def send_count_trace() -> aiohttp.TraceConfig:
    """The trace that counts each send of a request (a retry writes its headers a second time)."""
    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(_count_send)
    return trace


def upstream_session(config: ProxyConfig) -> aiohttp.ClientSession:
    """The client session to the upstream: no decompression (bytes pass as sent), no cookie jar
    (clients must not share cookies), no proxy settings from the environment, no pool limit."""
    options: dict[str, Any] = {"limit": 0, "keepalive_timeout": POOLED_IDLE_S, "enable_cleanup_closed": True}
    if _liveness_hook_fits():
        connector: aiohttp.TCPConnector = LivenessCheckedConnector(**options)
    else:  # pragma: no cover - another aiohttp: pool without the check, and say so once
        _log.warning("upstream_pool_unchecked", aiohttp=aiohttp.__version__,
                     note="this aiohttp has another connector shape: pooled connections are not checked")
        connector = aiohttp.TCPConnector(**options)
    return aiohttp.ClientSession(
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        trust_env=False,
        timeout=aiohttp.ClientTimeout(total=None, connect=config.connect_timeout_s, sock_read=None),
        connector=connector,
    )


def counted_twin(session: aiohttp.ClientSession) -> aiohttp.ClientSession:
    """A session on the same pool, alike in every option, that counts each send of a request.

    For the methods aiohttp may send twice (`SENT_AGAIN`): a trace costs every request it is on
    about 3 % of the proxy's CPU, and a POST, never sent twice, needs no count. Closing it leaves
    the pool to `session`."""
    return aiohttp.ClientSession(
        auto_decompress=session.auto_decompress,
        cookie_jar=session.cookie_jar,
        trust_env=session.trust_env,
        timeout=session.timeout,
        connector=session.connector,
        connector_owner=False,
        trace_configs=[send_count_trace()],
    )
