"""The one JSON line per response: written without structlog's chain, the same line it would write."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import structlog

import proxy.observers.logs as logs
from proxy.diagnosis.recorder import Recorder
from proxy.record import ResponseRecord
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
    observer.sink = None  # the same observer through structlog's chain
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


class _CountingBuffer(io.BytesIO):
    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.flushes = 0
        self.fail = fail

    def flush(self) -> None:
        self.flushes += 1
        if self.fail:
            raise BrokenPipeError("stdout is gone")


async def test_the_lines_of_one_loop_turn_are_flushed_once(stdout: _Stdout) -> None:
    import asyncio

    stdout.buffer = _CountingBuffer()
    logs.configure_logging("info", "json", stream=stdout)
    observer = logs.LogObserver("http://upstream")
    for _ in range(3):
        observer.on_response(_record())
    assert stdout.buffer.flushes == 0
    await asyncio.sleep(0)
    assert stdout.buffer.flushes == 1
    assert len(stdout.buffer.getvalue().splitlines()) == 3


async def test_a_flush_that_failed_is_said_by_the_next_line_written(stdout: _Stdout) -> None:
    import asyncio

    from proxy.diagnosis.delivery import Delivery

    stdout.buffer = _CountingBuffer(fail=True)
    logs.configure_logging("info", "json", stream=stdout)
    chain = Delivery([logs.LogObserver("http://upstream")])
    chain.response_finished(_record())
    await asyncio.sleep(0)  # the turn's flush fails
    stdout.buffer.fail = False
    record = _record()
    chain.response_finished(record)
    assert record.observer_errors and "stdout is gone" in record.observer_errors[0]


def test_outside_an_event_loop_each_line_is_flushed_at_once(stdout: _Stdout) -> None:
    stdout.buffer = _CountingBuffer()
    logs.configure_logging("info", "json", stream=stdout)
    logs.LogObserver("http://upstream").on_response(_record())
    assert stdout.buffer.flushes == 1


@pytest.mark.parametrize("epoch", [1796422099.0, 1796422099.5, 1796422099.000123, 1796422100.999999])
def test_the_timestamp_is_the_one_structlog_writes(epoch: float, monkeypatch: pytest.MonkeyPatch) -> None:
    import datetime

    monkeypatch.setattr(logs.time, "time", lambda: epoch)
    expected = datetime.datetime.fromtimestamp(epoch, tz=datetime.UTC).isoformat().replace("+00:00", "Z")
    assert logs._Clock().now_iso() == expected


def test_a_broken_stdout_never_breaks_the_observer_chain(stdout: _Stdout) -> None:
    """structlog's own lines raise on a broken stdout, the chain's warning among them: the chain
    goes on, and the record says what failed."""
    from proxy.diagnosis.delivery import Delivery

    stdout.buffer = _CountingBuffer(fail=True)
    logs.configure_logging("info", "json", stream=stdout)
    chain = Delivery([logs.LogObserver("http://upstream")])
    record = _record()
    chain.response_finished(record)  # outside a loop: the line's own flush fails, then the warning's
    assert record.observer_errors and "stdout is gone" in record.observer_errors[0]



def test_the_log_line_and_the_history_row_share_one_compact_dict_per_delivery(
        stdout: _Stdout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The record's compact dict is made once per delivery: the log line and the history's row use
    the same one, unchanged by either; and what each writes is what the record says."""
    from proxy.diagnosis.delivery import Delivery
    from proxy.observers.history import History
    from proxy.observers.history.backend import row_of
    from proxy.record import CompactOnce

    logs.configure_logging("info", "json", stream=stdout)
    compact_once = CompactOnce()  # the delivery's, passed to the observers that use it
    history = History(str(tmp_path / "h.sqlite3"), max_age_s=0, max_bytes=0, compact=compact_once)
    history._thread = object()  # type: ignore[assignment]  # a writer is running (the buffer is looked at here)
    record = _record()
    made: list[ResponseRecord] = []
    to_compact = ResponseRecord.to_compact_dict
    monkeypatch.setattr(ResponseRecord, "to_compact_dict", lambda self: (made.append(self), to_compact(self))[1])
    Delivery([logs.LogObserver("http://upstream:8000", compact_once), history],
             compact=compact_once).response_finished(record)
    assert made == [record]
    ((taken, body),) = history._pending
    assert taken is record and body == to_compact(record) and row_of(record, body) == row_of(record)
    line = orjson.loads(stdout.buffer.getvalue())
    assert line["request_id"] == "req-1" and "observer_errors" not in line and body["observer_errors"] == []
    assert compact_once.compact(record) is not body  # outside a delivery it is made anew


def test_a_delivered_record_holds_only_text_utf8_can_write(stdout: _Stdout) -> None:
    """Lone surrogates (a client's `\\ud800` escape, a header byte aiohttp decoded as one) become `?`
    before any observer sees the record; other text, non-ASCII included, is left as it is."""
    from proxy.diagnosis.delivery import Delivery

    logs.configure_logging("info", "json", stream=stdout)
    record = _record()
    record.model, record.upstream_request_id, record.finish_reason_raw = "\ud800m", "up-\udcff", "stop"
    record.upstream_error_detail = "café ☕"
    detail = record.upstream_error_detail
    Delivery([logs.LogObserver("http://upstream")]).response_finished(record)
    assert (record.model, record.upstream_request_id) == ("?m", "up-?")
    assert record.upstream_error_detail is detail and record.observer_errors == []
    line = orjson.loads(stdout.buffer.getvalue())
    assert line["model"] == "?m" and line["upstream_error_detail"] == "café ☕"


def test_a_librarys_warning_is_a_line_of_the_proxys_log_without_its_traceback(stdout: _Stdout) -> None:
    logs.configure_logging("info", "json", stream=stdout)
    server = logging.getLogger("aiohttp.server")
    server.warning("Error handling request from %s: %s", "127.0.0.1", "ClientConnectionResetError")
    try:
        raise ConnectionResetError("Connection lost")
    except ConnectionResetError:
        logging.getLogger("asyncio").exception("Exception in callback %s", "Handle._run")
    logging.getLogger("aiohttp.access").info("an access line: below what the libraries may say")
    lines = [orjson.loads(line) for line in stdout.buffer.getvalue().splitlines()]
    assert [(line["event"], line["level"], line["logger"]) for line in lines] == [
        ("Error handling request from 127.0.0.1: ClientConnectionResetError", "warning", "aiohttp.server"),
        ("Exception in callback Handle._run", "error", "asyncio")]
    assert lines[1]["error"] == "ConnectionResetError: Connection lost"
    assert lines[1]["at"].startswith("test_logs.py:") and "Traceback" not in stdout.buffer.getvalue().decode()


def test_configured_again_the_libraries_lines_are_written_once(stdout: _Stdout) -> None:
    logs.configure_logging("info", "json", stream=stdout)
    logs.configure_logging("info", "json", stream=stdout)
    logging.getLogger("aiohttp.server").warning("once")
    assert len(stdout.buffer.getvalue().splitlines()) == 1


def test_no_library_line_below_the_log_level(stdout: _Stdout) -> None:
    logs.configure_logging("error", "json", stream=stdout)
    logging.getLogger("aiohttp.server").warning("not at error")
    assert stdout.buffer.getvalue() == b""
