"""Logging: structlog configured once, and the observer that writes one event per response."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

import orjson
import structlog

from proxy.observers.hooks import Observer
from proxy.record import CompactOnce, ResponseRecord

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _orjson_dumps(event: Any, **_: Any) -> bytes:
    return orjson.dumps(event, default=str)


class _JsonSink:
    """Where JSON lines go, for the one line per response written without structlog's chain.

    Lines are flushed once per turn of the event loop, not once each: the responses that end in
    one turn cost one write(2). Outside a running loop each line is flushed at once. structlog's
    own lines flush the same buffer, so the order of lines is kept."""

    __slots__ = ("flush_due", "flush_failed", "level", "out")

    def __init__(self, out: Any, level: int) -> None:
        self.out = out
        self.level = level
        self.flush_due = False
        self.flush_failed: str | None = None

    def write(self, line: bytes) -> None:
        """Buffer a line; raises when an earlier flush failed (the observer chain notes it in the
        record that is being logged, and the lines of that turn are lost)."""
        failed, self.flush_failed = self.flush_failed, None
        if failed is not None:
            raise OSError(f"the log could not be written: {failed}")
        self.out.write(line)
        if self.flush_due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.out.flush()
            return
        self.flush_due = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        self.flush_due = False
        try:
            self.out.flush()
        except (OSError, ValueError) as exc:  # stdout gone or closed: the next line says so
            self.flush_failed = repr(exc)[:200]


class JsonLines:
    """structlog's logger factory for JSON lines, and the sink that the response lines share with it
    (found through structlog's own configuration, `json_sink`: no second global beside it)."""

    def __init__(self, binary: Any, level: int) -> None:
        self.sink = _JsonSink(binary, level)
        self._factory = structlog.BytesLoggerFactory(binary)

    def __call__(self, *args: Any) -> Any:
        return self._factory(*args)


def json_sink() -> _JsonSink | None:
    """Where response lines go when the logs are JSON (as configured now); None otherwise."""
    factory = structlog.get_config().get("logger_factory")
    return factory.sink if isinstance(factory, JsonLines) else None


def configure_logging(level: str = "info", fmt: str = "json", stream: Any = None) -> None:
    """JSON lines (bytes via orjson) or coloured console lines on stdout, filtered by level."""
    out = stream if stream is not None else sys.stdout
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if fmt == "json":
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer(_orjson_dumps)]
        binary: Any = getattr(out, "buffer", None) or out
        factory: Any = JsonLines(binary, _LEVELS.get(level, logging.INFO))
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=out.isatty() if hasattr(out, "isatty") else False))
        factory = structlog.PrintLoggerFactory(out)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=factory,
        cache_logger_on_first_use=False,
    )
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, LibraryLines)]:
        root.removeHandler(handler)
    root.addHandler(LibraryLines(max(logging.WARNING, _LEVELS.get(level, logging.INFO))))


def raised_at(error: BaseException) -> str | None:
    """Where `error` was raised, as a log line names it: the innermost frame's file and line."""
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return None if frame is None else f"{frame.tb_frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.tb_lineno}"


class LibraryLines(logging.Handler):
    """The libraries' own warnings (aiohttp's server, asyncio's loop) as lines of the proxy's log, in
    its format: without it they reach stderr as bare text beside the JSON lines (Python's last-resort
    handler), and a traceback with them. An exception is named by its type, its message and where
    it was raised, never by its traceback."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields: dict[str, Any] = {"logger": record.name}
            error = record.exc_info[1] if record.exc_info else None
            if error is not None:
                fields["error"] = f"{type(error).__name__}: {error}"[:300]
                at = raised_at(error)
                if at is not None:
                    fields["at"] = at
            structlog.get_logger("llm_diag_proxy").log(record.levelno, record.getMessage()[:1000], **fields)
        except Exception:  # a log that cannot be written (stdout gone): nowhere left to say so
            return


class _Clock:
    """The timestamp structlog's TimeStamper(fmt="iso", utc=True) writes, made from the epoch:
    the date and time of day formatted once per second, the microseconds each time
    (`datetime.isoformat` leaves them out when they are 0, and so does this)."""

    __slots__ = ("_second", "_text")

    def __init__(self) -> None:
        self._second = -1
        self._text = ""

    def now_iso(self) -> str:
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second = second
            self._text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        micro = int((now - second) * 1_000_000)
        return f"{self._text}.{micro:06d}Z" if micro else f"{self._text}Z"


_now_iso = _Clock().now_iso


# Fields of a record that are logged; no prompt or completion text is ever in a record.
class LogObserver(Observer):
    """Writes `event="response"` with the record's fields as flat keys.

    With JSON logs the line is made here, key for key what structlog's chain would write (bound
    fields and context, the record, the event, level, timestamp), in one orjson call: the chain's processors
    cost about as much again, once per response."""

    def __init__(self, upstream: str, compact: CompactOnce | None = None) -> None:
        """`compact`: the delivery's one compact dict per record (made here each time without it).
        The logs' format is the one configured when the observer is made."""
        self.upstream = upstream
        self._log = structlog.get_logger("llm_diag_proxy").bind(upstream=upstream)
        self._compact = compact if compact is not None else CompactOnce()
        self.sink = json_sink()

    def on_response(self, record: ResponseRecord) -> None:
        sink = self.sink
        if sink is not None and sink.level > logging.INFO:
            return
        fields = self._compact.compact(record)  # (no None values: the line leaves them out; not to be changed)
        if sink is None:
            self._log.info("response", **{k: v for k, v in fields.items() if v or k != "observer_errors"})
            return
        line: dict[str, Any] = {"upstream": self.upstream}
        line.update(fields)
        if not line["observer_errors"]:
            del line["observer_errors"]
        line["event"] = "response"
        for key, value in structlog.contextvars.get_contextvars().items():
            line.setdefault(key, value)
        line["level"] = "info"
        line["timestamp"] = _now_iso()
        sink.write(orjson.dumps(line, default=str) + b"\n")
