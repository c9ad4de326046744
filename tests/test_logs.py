"""The one JSON line per response: written without structlog's chain, the same line it would write."""

from __future__ import annotations

import io
from collections.abc import Iterator

import orjson
import pytest
import structlog

import proxy.logs as logs
from proxy.record import ResponseRecord
from proxy.recorder import Recorder
from tests.support.wire import openai_stream


class _Stdout:
    def __init__(self) -> None:
        self.buffer = io.BytesIO()


@pytest.fixture
def stdout() -> Iterator[_Stdout]:
    out = _Stdout()
    yield out
    structlog.contextvars.clear_contextvars()
    logs.configure_logging("info", "json")


def _record() -> ResponseRecord:
    recorder = Recorder.start("req-1", "POST", "/v1/chat/completions", started=0.0)
    recorder.request_body(b'{"model":"m","stream":true,"max_tokens":3}')
    recorder.response_head(200, "text/event-stream", "", None)
    for chunk in openai_stream(3, "length"):
        recorder.chunk(chunk, 0.01)
    recorder.body_ended(0.02)
    return recorder.finish()


@pytest.mark.parametrize("context", [{}, {"worker": 2}])
def test_the_response_line_is_key_for_key_what_structlog_writes(stdout: _Stdout, context: dict[str, int]) -> None:
    structlog.contextvars.bind_contextvars(**context)
    logs.configure_logging("info", "json", stream=stdout)
    observer, record = logs.LogObserver("http://upstream:8000"), _record()
    observer.on_response(record)
    logs._json_sink = None  # the same observer through structlog's chain
    observer.on_response(record)
    direct, chained = (orjson.loads(line) for line in stdout.buffer.getvalue().splitlines())
    assert list(direct) == list(chained) and direct["timestamp"].endswith("Z")
    del direct["timestamp"], chained["timestamp"]
    assert direct == chained
    assert direct["event"] == "response" and direct["stop_reason"] == "length"


def test_no_response_line_below_the_log_level(stdout: _Stdout) -> None:
    logs.configure_logging("warning", "json", stream=stdout)
    logs.LogObserver("http://upstream:8000").on_response(_record())
    assert stdout.buffer.getvalue() == b""
