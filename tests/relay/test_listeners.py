"""The proxy port's connection handler: aiohttp's, with each request's handler awaited in the
connection's own task on Python 3.11 (`GuardedRequestHandler.start`). What a client sees is aiohttp's:
keep-alive, a body the handler left unread, a handler that fails, a client that leaves."""

from __future__ import annotations

import asyncio
import sys

import pytest
from aiohttp import web

from proxy.config import HostPort
from proxy.relay.listeners import Handler, listen


async def serving(handler: Handler) -> tuple[web.BaseRunner, int]:
    runner, _, url = await listen(handler, HostPort("127.0.0.1", 0), backlog=16, header_timeout_s=5.0)
    return runner, int(url.rsplit(":", 1)[1])


async def answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One answer with a length: its status line and its body."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length"))
    return lines[0], await reader.readexactly(length)


async def test_requests_on_one_connection_are_answered_in_turn_in_its_own_task() -> None:
    tasks: list[asyncio.Task[object] | None] = []

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        tasks.append(asyncio.current_task())
        assert request.task is asyncio.current_task()
        return web.Response(text=f"answer {len(tasks)}")

    runner, port = await serving(handler)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for n in (1, 2, 3):
            writer.write(b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n")
            assert await answer(reader) == (b"HTTP/1.1 200 OK", b"answer %d" % n)
        writer.close()
    finally:
        await runner.cleanup()
    if sys.version_info < (3, 12):  # (from 3.12 on aiohttp's own start runs, a task per request started eagerly)
        assert tasks[0] is tasks[1] is tasks[2]


async def test_a_body_the_handler_left_unread_is_read_past_and_the_connection_goes_on() -> None:
    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        return web.Response(text=request.path)

    runner, port = await serving(handler)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /first HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nhello"
                     b"GET /second HTTP/1.1\r\nHost: h\r\n\r\n")
        assert await answer(reader) == (b"HTTP/1.1 200 OK", b"/first")
        assert await answer(reader) == (b"HTTP/1.1 200 OK", b"/second")
        writer.close()
    finally:
        await runner.cleanup()


async def test_a_handler_that_fails_gets_aiohttps_500_and_the_server_keeps_serving(
        caplog: pytest.LogCaptureFixture) -> None:
    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        if request.path == "/fail":
            raise RuntimeError("a bug")
        return web.Response(text="ok")

    runner, port = await serving(handler)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /fail HTTP/1.1\r\nHost: h\r\n\r\n")
        status, _ = await answer(reader)
        assert status == b"HTTP/1.1 500 Internal Server Error"
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /ok HTTP/1.1\r\nHost: h\r\n\r\n")
        assert await answer(reader) == (b"HTTP/1.1 200 OK", b"ok")
        writer.close()
    finally:
        await runner.cleanup()


async def test_a_client_that_leaves_mid_answer_ends_its_connection_quietly(caplog: pytest.LogCaptureFixture) -> None:
    finished = asyncio.Event()

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        try:
            for _ in range(200):
                await response.write(b"x" * 1024)
                await asyncio.sleep(0.005)
        except ConnectionError:
            pass
        finally:
            finished.set()
        return response

    runner, port = await serving(handler)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: h\r\n\r\n")
        await reader.readuntil(b"\r\n\r\n")
        writer.transport.abort()
        await asyncio.wait_for(finished.wait(), 5)
        await asyncio.sleep(0.05)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # the server is still there
        writer.write(b"GET /stream HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 OK")
        writer.close()
    finally:
        await runner.cleanup()
    assert "Unhandled exception" not in caplog.text and "Traceback" not in caplog.text
