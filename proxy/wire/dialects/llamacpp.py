"""llama.cpp's native completion API: `/completion` (and `/completions`, the same handler).

Checked against llama.cpp's tools/server (server-task.cpp, to_json_non_oaicompat): each
streamed object has `content` and `stop`; the last (`stop: true`) adds `stop_type` (`eos`,
`word` for a stop string, `limit` for `n_predict` or a full context), `stopping_word`,
`truncated` (context shift), `tokens_predicted`, `tokens_evaluated` and `timings` in ms.
"""

from __future__ import annotations

from typing import Any

from proxy.record import RequestInfo, StopReason
from proxy.wire.dialects.base import (
    Dialect,
    as_count,
    error_event,
    expect_object,
    out_of_range,
    positive_count,
    read_common,
    read_prompt_text,
)
from proxy.wire.dialects.openai import timings_of
from proxy.wire.events import ONE_TOKEN, AnswerText, Event, Finish, Usage

ROUTES = ("/completion", "/completions")

STOP_TYPES: dict[str, StopReason] = {"eos": "eos", "word": "stop_sequence", "limit": "length"}


def events(obj: Any) -> list[Event]:
    """Events in one object of the native `/completion` endpoint."""
    obj = expect_object(obj)
    if "error" in obj:
        return [error_event(obj["error"])]
    found: list[Event] = []
    if obj.get("content"):
        found.append(ONE_TOKEN)
    if obj.get("stop") is True:
        raw = obj.get("stop_type")
        word = obj.get("stopping_word")
        truncated = obj.get("truncated")
        stop = STOP_TYPES.get(str(raw), "unknown") if raw is not None else "unknown"
        found.append(Finish(None if raw is None else str(raw), stop, 0, str(word) if word else None,
                            truncated if isinstance(truncated, bool) else None))
        predicted, evaluated = as_count(obj.get("tokens_predicted")), as_count(obj.get("tokens_evaluated"))
        ignored = out_of_range(obj, "tokens_predicted", "tokens_evaluated")
        if predicted is not None or evaluated is not None or ignored:
            found.append(Usage(evaluated, predicted, ignored=ignored))
        if isinstance(obj.get("timings"), dict):
            found.append(timings_of(obj["timings"]))
    return found


def texts(obj: Any) -> list[Event]:
    """The answer's text: `content` of each object."""
    content = obj.get("content") if isinstance(obj, dict) else None
    return [AnswerText("content", "0", content)] if isinstance(content, str) and content else []


def read_request(obj: dict[str, Any], info: RequestInfo) -> None:
    read_common(obj, info, budget_fields=("max_completion_tokens", "max_tokens", "n_predict"))
    info.stop_requested = bool(obj.get("stop"))
    info.n_keep = positive_count(obj, "n_keep", info, allowed=(-1,))  # -1: keep the whole prompt
    read_prompt_text(obj.get("prompt"), info)


DIALECT = Dialect(name="llamacpp", routes=ROUTES, read_request=read_request, events=events,
                  token_keys=(b'"content":"',), provider="llama.cpp", sweep_dialect="openai", texts=texts)
