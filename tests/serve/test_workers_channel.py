"""The pipe between a worker and its supervisor, in one process: what `RecordSender` writes is what
`FrameReader` reads, record for record and field for field; one turn's messages go in one write;
past its bound the sender drops records, counts them and says so."""

from __future__ import annotations

import asyncio
import dataclasses
import types
import typing
from typing import Any

import pytest

from proxy.record import ResponseRecord, record_from_dict
from proxy.serve import workers
from proxy.serve.workers import FrameReader, RecordSender


class Pipe:
    """A write transport that keeps each write; `closing` as a closed pipe says."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closing = False
        self.held = 0  # what the transport says it still holds

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.held

    def close(self) -> None:
        self.closing = True


def value_for(hint: Any) -> Any:
    """A value of the hinted type that is not the field's default (None, 0, False, empty)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return args[-1]
    if origin in (typing.Union, types.UnionType):
        return value_for(args[0])
    if origin is list:
        return ["a note", "another"]
    if origin is dict:
        return {"prompt_eval_s": 0.25, "eval_s": 1.5}
    return {bool: True, int: 7, float: 2.5, str: "text é ✓"}[hint]


def every_field_set() -> ResponseRecord:
    hints = typing.get_type_hints(ResponseRecord)
    return ResponseRecord(**{f.name: value_for(hints[f.name]) for f in dataclasses.fields(ResponseRecord)})


def fewest_fields() -> ResponseRecord:
    return ResponseRecord(request_id="r", method="GET", path="/", route="other", dialect="openai", started_at=1.0)


def read_back(writes: list[bytes]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    reader = FrameReader(messages.append, lambda: None)
    for data in writes:
        for at in range(0, len(data), 7):  # in pieces, as a pipe may give them
            reader.data_received(data[at:at + 7])
    return messages


@pytest.mark.parametrize("make", [every_field_set, fewest_fields])
async def test_a_record_crosses_the_pipe_field_for_field(make: Any) -> None:
    record = make()
    pipe = Pipe()
    sender = RecordSender(pipe)  # type: ignore[arg-type]
    sender.on_response_start(record)
    sender.on_response(record)
    await asyncio.sleep(0)
    (message,) = read_back(pipe.writes)
    assert record_from_dict(message["record"]) == record


async def test_the_messages_of_one_turn_go_in_one_write_and_the_ledger_counts_them() -> None:
    pipe = Pipe()
    ledger = [0, 0, 0, 0]
    sender = RecordSender(pipe, ledger, owner=1)  # type: ignore[arg-type]
    records = [dataclasses.replace(fewest_fields(), request_id=f"r{i}") for i in range(5)]
    for record in records:
        sender.on_response_start(record)
    for record in records:
        sender.on_response(record)
    sender.refused("header_timeout")
    assert pipe.writes == []  # not yet: at the end of the turn
    assert ledger[2:] == [0, 5]  # none begun without a record; five written
    await asyncio.sleep(0)
    assert len(pipe.writes) == 1
    messages = read_back(pipe.writes)
    assert [m["record"]["request_id"] for m in messages[:5]] == [f"r{i}" for i in range(5)]
    assert messages[5] == {"refused": "header_timeout"}
    sender.on_response(records[0])
    await sender.flush(1.0)  # what the last turn queued is written before the pipe closes
    assert len(pipe.writes) == 2


async def test_past_its_bound_a_sender_drops_records_counts_them_and_says_so() -> None:
    pipe = Pipe()
    sender = RecordSender(pipe)  # type: ignore[arg-type]
    pipe.held = workers.SEND_BUFFER_MAX + 1
    sender.on_response(fewest_fields())
    sender.on_response(fewest_fields())
    await asyncio.sleep(0)
    assert pipe.writes == [] and sender.lost == 2
    pipe.held = 0
    sender.on_response(fewest_fields())
    await asyncio.sleep(0)
    messages = read_back(pipe.writes)
    assert messages[0] == {"lost": 2} and "record" in messages[1]


async def test_what_a_closed_pipe_would_have_carried_is_dropped_not_raised() -> None:
    pipe = Pipe()
    sender = RecordSender(pipe)  # type: ignore[arg-type]
    sender.on_response(fewest_fields())
    pipe.closing = True  # closed before the turn's end: written in the ledger, never read (lost)
    await asyncio.sleep(0)
    assert pipe.writes == []
    sender.on_response(fewest_fields())
    assert sender.lost == 1
