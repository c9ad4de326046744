"""A record every place it goes can take: JSON, a metric label, a log line, SQLite, PostgreSQL, OTLP.

Whatever the wire held (a lone surrogate a JSON parser let through, an integer past 64 bits), the
diagnosis makes each record writable where it makes it, in one process and in workers alike, so that
no value of one record can cost a client its connection or other records their place.
"""

from __future__ import annotations

import math
import operator

import orjson

from proxy.record import (
    INT64_MAX,
    INT64_MIN,
    INT_FIELDS,
    OPTIONAL_INT_FIELDS,
    TEXT_FIELDS,
    ResponseRecord,
    utf8_text,
)

_text_values = operator.attrgetter(*TEXT_FIELDS)
_int_values = operator.attrgetter(*INT_FIELDS)


def make_writable(record: ResponseRecord) -> None:
    """Every value of a record as JSON, a metric label, a log line, SQLite, PostgreSQL and OTLP can take
    it, wherever it came from: text valid UTF-8 (a lone surrogate becomes `?`), integers within 64
    bits (one past them is not said: None, and `values_ignored` says so), the timings finite. The usual
    record is looked at in a few C calls (orjson refuses text that UTF-8 cannot hold)."""
    texts = _text_values(record)
    try:
        orjson.dumps(texts)
    except TypeError:
        for name, value in zip(TEXT_FIELDS, texts, strict=True):
            if value:
                fixed = utf8_text(value)
                if fixed is not value:
                    setattr(record, name, fixed)
    wide = [(name, value) for name, value in zip(INT_FIELDS, _int_values(record), strict=True)
            if value is not None and not INT64_MIN <= value <= INT64_MAX]
    for name, value in wide:
        default = None if name in OPTIONAL_INT_FIELDS else 0
        setattr(record, name, default)
        note = f"{name}={str(value)[:24]}"
        record.values_ignored = note if not record.values_ignored else f"{record.values_ignored}, {note}"[:200]
    if record.observer_errors:
        record.observer_errors = [utf8_text(error) for error in record.observer_errors]
    if record.server_timings:
        record.server_timings = {utf8_text(k): v for k, v in record.server_timings.items()
                                 if isinstance(v, float | int) and math.isfinite(v)}
