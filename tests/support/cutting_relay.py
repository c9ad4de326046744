"""A TCP relay that closes every connection a fixed time after it opened: a timeout in the path,
as a gateway, a load balancer or nginx's proxy_read_timeout would end a long answer."""

from __future__ import annotations

import asyncio
import contextlib


class CuttingRelay:
    """Forwards bytes both ways to `target_port`, and closes both sides `after_s` seconds in."""

    def __init__(self, target_port: int, after_s: float) -> None:
        self.target_port = target_port
        self.after_s = after_s
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        pipes = [asyncio.ensure_future(self._pipe(reader, up_writer)),
                 asyncio.ensure_future(self._pipe(up_reader, writer))]
        try:
            await asyncio.wait(pipes, timeout=self.after_s, return_when=asyncio.ALL_COMPLETED)
        finally:
            for pipe in pipes:
                pipe.cancel()
            for side in (writer, up_writer):
                with contextlib.suppress(Exception):
                    side.transport.abort()  # a timer's cut: no orderly end
            self._tasks.discard(task)  # type: ignore[arg-type]

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
