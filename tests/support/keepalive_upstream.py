"""A raw HTTP/1.1 server that keeps connections open, and closes them the ways servers do: after
some answers (a keep-alive that ran out), after every answer despite `Keep-Alive`, or a moment
after a streamed answer (llama-server)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import orjson

ANSWER = orjson.dumps({"id": "cmpl-1", "object": "chat.completion", "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]})
REQUEST = orjson.dumps({"model": "m", "stream": False, "messages": [{"role": "user", "content": "x"}]})
STREAM_REQUEST = orjson.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]})
STREAM = (b'data: {"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":'
          b'{"content":"hi"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')


@dataclass
class KeepAliveUpstream:
    """A raw HTTP/1.1 server that keeps connections open; `answer_per_connection` limits how
    many requests one connection gets answered: the next one is read, then the connection is
    closed unanswered, as by a server whose keep-alive ran out just as the request came."""

    answer_per_connection: int | None = None
    close_after_answer: bool = False  # llama-server: answers with Keep-Alive, then closes anyway
    close_after_stream_s: float | None = None  # llama-server: closes this long after a streamed answer
    connections: int = 0
    answered: int = 0
    dropped: int = 0
    bodies: list[bytes] = field(default_factory=list)
    server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                if self.answer_per_connection is not None and served >= self.answer_per_connection:
                    self.dropped += 1
                    break
                served += 1
                self.answered += 1
                self.bodies.append(body)
                if self.close_after_stream_s is not None and b'"stream":true' in body:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: keep-alive\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(STREAM), STREAM))
                    await writer.drain()
                    await asyncio.sleep(self.close_after_stream_s)  # what arrives meanwhile is never read
                    break
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: keep-alive\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(ANSWER) + ANSWER)
                await writer.drain()
                if self.close_after_answer:
                    break
        writer.close()
