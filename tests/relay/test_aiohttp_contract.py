"""The private names of its dependencies that the proxy relies on, checked as they are installed.

pyproject.toml pins aiohttp to the minor version these were read in (3.14): when a later one
changes any of them, this file fails first, with the place in the proxy that needs another look,
before any user meets it. Raise the pin only with this file green."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import inspect
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.client_proto import ResponseHandler
from aiohttp.http import StreamWriter
from aiohttp.web_protocol import RequestHandler

from tests.support.mock_transport import MockTransport

TESTED_MINOR = (3, 14)


def parameters(function: Callable[..., Any]) -> list[str]:
    return list(inspect.signature(function).parameters)


def explain(name: str, where: str) -> str:
    return (f"aiohttp {aiohttp.__version__} changed {name}, which {where} relies on: read that code against "
            f"the new aiohttp before raising the pin in pyproject.toml")


def test_the_installed_aiohttp_is_the_minor_version_the_pin_allows() -> None:
    assert tuple(int(p) for p in aiohttp.__version__.split(".")[:2]) == TESTED_MINOR, explain(
        "its version", "the pin (aiohttp>=3.14,<3.15)")


def test_the_response_protocol_the_upstream_connection_extends() -> None:
    where = "proxy/relay/upstream/connection.py (Connection)"
    assert parameters(ResponseHandler.__init__) == ["self", "loop"], explain("ResponseHandler.__init__", where)
    options = parameters(ResponseHandler.set_response_params)
    for name in ("skip_payload", "read_until_eof", "auto_decompress", "read_bufsize"):
        assert name in options, explain(f"ResponseHandler.set_response_params({name}=...)", where)
    assert inspect.iscoroutinefunction(ResponseHandler._drain_helper), explain("ResponseHandler._drain_helper", where)
    assert parameters(ResponseHandler._drain_helper) == ["self"], explain("ResponseHandler._drain_helper", where)
    for name in ("connection_made", "data_received", "read", "set_exception", "exception", "close", "force_close",
                 "is_connected", "should_close", "closed", "transport"):
        assert hasattr(ResponseHandler, name) or name == "transport", explain(f"ResponseHandler.{name}", where)


async def test_the_response_protocol_reads_an_answer_as_the_connection_uses_it() -> None:
    protocol = ResponseHandler(asyncio.get_running_loop())
    protocol.connection_made(MockTransport())
    assert protocol.transport is not None and protocol.is_connected()
    protocol.set_response_params(skip_payload=False, read_until_eof=True, auto_decompress=False, read_bufsize=65536)
    protocol.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    message, payload = await protocol.read()
    assert (message.code, await payload.read(), protocol.should_close) == (200, b"ok", False), explain(
        "ResponseHandler.read", "proxy/relay/upstream/pool.py (UpstreamPool._exchange)")


def test_the_response_head_hook_the_relay_overrides() -> None:
    where = "proxy/relay/forward.py (RelayedResponse), proxy/relay/listeners.py (OwnResponse)"
    assert inspect.iscoroutinefunction(web.StreamResponse._prepare_headers), explain(
        "StreamResponse._prepare_headers", where)
    assert parameters(web.StreamResponse._prepare_headers) == ["self"], explain(
        "StreamResponse._prepare_headers", where)


def test_the_prepared_state_the_relay_sets_for_its_own_head() -> None:
    """`RelayedResponse.start_chunked` prepares the response as aiohttp's `_start` does: a response
    with a payload writer is prepared (prepare returns it), its keep-alive is `_keep_alive`, its
    request `_req`; tests/relay/test_forward.py compares the heads byte for byte."""
    where = "proxy/relay/forward.py (RelayedResponse.start_chunked)"
    source = inspect.getsource(web.StreamResponse._start)
    for name in ("self._req = request", "self._payload_writer = request._payload_writer"):
        assert name in source, explain("StreamResponse._start", where)
    assert "self._payload_writer is not None" in inspect.getsource(web.StreamResponse.prepare), explain(
        "StreamResponse.prepare", where)
    assert "self._keep_alive" in inspect.getsource(web.StreamResponse._prepare_headers), explain(
        "StreamResponse._prepare_headers", where)


def test_the_head_writing_the_relay_replaces_for_its_own_bytes() -> None:
    """`RelayedResponse._write_headers` does what aiohttp's does, then puts its own bytes where the
    writer keeps the head until it is sent; tests/relay/test_forward.py compares the bytes."""
    where = "proxy/relay/forward.py (RelayedResponse._write_headers)"
    assert inspect.iscoroutinefunction(web.StreamResponse._write_headers), explain(
        "StreamResponse._write_headers", where)
    source = inspect.getsource(web.StreamResponse._write_headers)
    for name in ("writer.write_headers(status_line, self._headers)", "self._send_headers_immediately",
                 "writer.send_headers()"):
        assert name in source, explain("StreamResponse._write_headers", where)
    write_headers = inspect.getsource(StreamWriter.write_headers)
    assert "self._headers_buf = buf" in write_headers and "self._headers_written = False" in write_headers, explain(
        "StreamWriter.write_headers", where)
    assert "self._headers_buf" in inspect.getsource(StreamWriter.send_headers), explain("StreamWriter.send_headers",
                                                                                        where)


async def test_the_stream_writer_the_relay_ends_with_trailers() -> None:
    where = "proxy/relay/forward.py (_end_with_trailers)"
    protocol = ResponseHandler(asyncio.get_running_loop())
    protocol.connection_made(MockTransport())
    writer = StreamWriter(protocol, asyncio.get_running_loop())
    assert writer.chunked is False, explain("StreamWriter.chunked", where)
    writer.enable_chunking()
    assert writer.chunked is True, explain("StreamWriter.enable_chunking", where)


def test_the_request_handler_and_servers_the_listeners_extend() -> None:
    where = "proxy/relay/listeners.py (GuardedRequestHandler, GuardedServer, GuardedRunner)"
    assert parameters(RequestHandler.handle_error) == ["self", "request", "status", "exc", "message"], explain(
        "RequestHandler.handle_error", where)
    assert {"_manager", "logger"} <= set(RequestHandler.__slots__), explain("RequestHandler._manager/logger", where)
    loop = asyncio.new_event_loop()
    server = web.Server(lambda request: None, loop=loop, keepalive_timeout=5)  # type: ignore[arg-type,return-value]
    assert isinstance(server._kwargs, dict) and server._loop is not None, explain("Server._kwargs/_loop", where)
    assert not hasattr(web.Server, "__slots__"), explain("Server (now with __slots__: no class swap)", where)
    assert inspect.iscoroutinefunction(web.AppRunner._make_server), explain("AppRunner._make_server", where)
    loop.close()


# aiohttp 3.14.5's RequestHandler.start, which GuardedRequestHandler.start copies on Python 3.11.
REQUEST_HANDLER_START_SHA256 = "2e565fd40c8e04fb3afb481d5ba52691a61d28396573b4b8a4cf3b168782288e"


def test_the_connection_loop_the_listener_copies_on_python_3_11() -> None:
    where = "proxy/relay/listeners.py (GuardedRequestHandler.start, a copy of it with one change)"
    source = inspect.getsource(RequestHandler.start)
    assert hashlib.sha256(source.encode()).hexdigest() == REQUEST_HANDLER_START_SHA256, explain(
        "RequestHandler.start", where)
    slots = {name for kind in RequestHandler.__mro__ for name in getattr(kind, "__slots__", ())}
    for name in ("_messages", "_waiter", "_parser", "_buffer_paused", "_msg_queue_resume_size", "_logging_enabled",
                 "_request_factory", "_request_handler", "_task_handler", "_keepalive", "_lingering_time",
                 "_keepalive_handle", "_next_keepalive_close_time", "_force_close", "_close", "_keepalive_timeout"):
        assert name in slots, explain(f"RequestHandler.{name}", where)
    for name in ("_resume_reading_if_drained", "_make_error_handler", "_handle_request", "_process_keepalive"):
        assert callable(getattr(RequestHandler, name, None)), explain(f"RequestHandler.{name}", where)


async def test_a_started_site_names_its_server() -> None:
    runner = web.ServerRunner(web.Server(lambda request: None))  # type: ignore[arg-type,return-value]
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        assert site._server is not None and site._server.sockets, explain(  # type: ignore[union-attr]
            "TCPSite._server", "proxy/relay/listeners.py (listen)")
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("name", ["BadHttpMessage", "BadStatusLine", "HttpProcessingError", "InvalidHeader",
                                  "LineTooLong"])
def test_the_parser_errors_the_relay_tells_apart(name: str) -> None:
    import aiohttp.http_exceptions as errors

    assert issubclass(getattr(errors, name, type(None)), Exception), explain(
        f"http_exceptions.{name}", "proxy/relay/listeners.py and proxy/relay/upstream/pool.py")


def test_argparse_keeps_its_actions_where_demo_hides_a_flag() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--upstream", help="x")
    actions = [a for a in parser._actions if a.dest == "upstream"]
    assert len(actions) == 1 and actions[0].help == "x", (
        "argparse changed ArgumentParser._actions, which proxy/serve/demo.py relies on to hide --upstream")
