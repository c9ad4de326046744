"""Logging: structlog configured once, and the observer that writes one event per response."""

from __future__ import annotations

import datetime
import logging
import sys
from typing import Any

import orjson
import structlog

from proxy.record import ResponseRecord

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _orjson_dumps(event: Any, **_: Any) -> bytes:
    return orjson.dumps(event, default=str)


class _JsonSink:
    """Where JSON lines go, for the one line per response written without structlog's chain."""

    __slots__ = ("level", "out")

    def __init__(self, out: Any, level: int) -> None:
        self.out = out
        self.level = level


_json_sink: _JsonSink | None = None


def configure_logging(level: str = "info", fmt: str = "json", stream: Any = None) -> None:
    """JSON lines (bytes via orjson) or coloured console lines on stdout, filtered by level."""
    global _json_sink
    out = stream if stream is not None else sys.stdout
    _json_sink = None
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if fmt == "json":
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer(_orjson_dumps)]
        binary: Any = getattr(out, "buffer", None) or out
        factory: Any = structlog.BytesLoggerFactory(binary)
        _json_sink = _JsonSink(binary, _LEVELS.get(level, logging.INFO))
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=out.isatty() if hasattr(out, "isatty") else False))
        factory = structlog.PrintLoggerFactory(out)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=factory,
        cache_logger_on_first_use=False,
    )


def _now_iso() -> str:
    """The timestamp structlog's TimeStamper(fmt="iso", utc=True) writes."""
    return datetime.datetime.now(tz=datetime.UTC).isoformat().replace("+00:00", "Z")


# Fields of a record that are logged; no prompt or completion text is ever in a record.
class LogObserver:
    """Writes `event="response"` with the record's fields as flat keys.

    With JSON logs the line is made here, key for key what structlog's chain would write (bound
    fields and context, the record, the event, level, timestamp), in one orjson call: the chain's processors
    cost about as much again, once per response."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self._log = structlog.get_logger("llm_diag_proxy").bind(upstream=upstream)

    def on_response(self, record: ResponseRecord) -> None:
        fields = record.to_dict()
        if not fields["observer_errors"]:
            del fields["observer_errors"]
        sink = _json_sink
        if sink is None:
            self._log.info("response", **{k: v for k, v in fields.items() if v is not None})
            return
        if sink.level > logging.INFO:
            return
        line: dict[str, Any] = {"upstream": self.upstream}
        line.update({k: v for k, v in fields.items() if v is not None})
        line["event"] = "response"
        for key, value in structlog.contextvars.get_contextvars().items():
            line.setdefault(key, value)
        line["level"] = "info"
        line["timestamp"] = _now_iso()
        sink.out.write(orjson.dumps(line, default=str) + b"\n")
        sink.out.flush()
