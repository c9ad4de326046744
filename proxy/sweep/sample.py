"""One response of a sweep: the proxy's record (or the client's own) plus what the client measured."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from proxy.record import ResponseRecord

RecordSource = Literal["proxy", "client"]


@dataclass(slots=True)
class ClientMeasure:
    """What the sweep's own client saw of one response; times in seconds from sending the request."""

    status: int | None = None
    ttft_s: float | None = None
    itl_mean_s: float | None = None
    itl_p95_s: float | None = None
    chunks: int = 0
    duration_s: float = 0.0
    in_flight_at_start: int = 0
    error: str | None = None
    sent_s: float = 0.0  # when it was sent, in seconds from the start of its level
    rate: float | None = None  # the arrival rate it was sent at (an open-loop sweep), requests per second
    answer_hash: str | None = None  # SHA-256 (16 hex) of the visible text the client got; the text is not kept
    via_proxy: bool = False  # the answer came through llm-diag-proxy (it carried X-LLM-Diag-Concurrency)


@dataclass(slots=True)
class Sample:
    """One response at one concurrency level.

    `record` is the proxy's record when the sweep could join it through `--admin`
    (`record_source="proxy"`), else one the sweep built from its own parse of the stream.
    """

    level: int
    index: int
    request_id: str
    record: ResponseRecord
    record_source: RecordSource
    client: ClientMeasure
    join_note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"level": self.level, "index": self.index, "request_id": self.request_id,
                "record_source": self.record_source, "join_note": self.join_note,
                "client": asdict(self.client), "record": self.record.to_dict()}
