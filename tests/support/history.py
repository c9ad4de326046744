"""Records for the history's tests, and a history written with retention at every turn."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import replace

from proxy.observers.history import History
from proxy.record import ResponseRecord


def record(request_id: str, started_at: float, **fields: object) -> ResponseRecord:
    """A complete streamed answer of model `m`, seen by proxy `a:8080`; `fields` change it."""
    base = ResponseRecord(request_id=request_id, method="POST", path="/v1/chat/completions",
                          route="/v1/chat/completions", dialect="openai", started_at=started_at, model="m",
                          status=200, output_tokens=10, stop_reason="eos", instance="a:8080",
                          upstream="http://10.0.0.1:8000")
    return replace(base, **fields)  # type: ignore[arg-type]


async def written_with_retention(history: History, records: Iterable[ResponseRecord]) -> None:
    """Open the history with retention at every turn of its writer, hand it `records`, close it."""
    history.retention_every_s = 0.0
    assert history.open()
    for each in records:
        history.on_response(each)
    await asyncio.to_thread(history.close)
