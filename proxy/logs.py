"""Logging: structlog configured once, and the observer that writes one event per response."""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson
import structlog

from proxy.record import ResponseRecord

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _orjson_dumps(event: Any, **_: Any) -> bytes:
    return orjson.dumps(event, default=str)


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
        factory: Any = structlog.BytesLoggerFactory(binary)
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=out.isatty() if hasattr(out, "isatty") else False))
        factory = structlog.PrintLoggerFactory(out)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=factory,
        cache_logger_on_first_use=False,
    )


# Fields of a record that are logged; no prompt or completion text is ever in a record.
class LogObserver:
    """Writes `event="response"` with the record's fields as flat keys."""

    def __init__(self, upstream: str) -> None:
        self._log = structlog.get_logger("llm_diag_proxy").bind(upstream=upstream)

    def on_response(self, record: ResponseRecord) -> None:
        fields = record.to_dict()
        if not fields["observer_errors"]:
            del fields["observer_errors"]
        self._log.info("response", **{k: v for k, v in fields.items() if v is not None})
