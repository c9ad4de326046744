"""Can the answer be used? For a request that asked for structure, whether its structured parts are
whole when it ends: each tool call's arguments, and an answer asked to be JSON.

A finish reason can hide a cut. vLLM reports a tool call cut by `max_tokens` as `finish_reason:
"tool_calls"`, not `length` (vllm-project/vllm#53269, #58228); a structured-output answer can end
`stop` with its JSON still open (vllm#12548 stops at `{`). So at the end of such an answer:

- A tool call whose arguments are not whole JSON, in an answer whose output reached the requested
  budget (by the server's count, or the proxy's own, a lower bound that proves a budget reached),
  was cut by the budget, whatever the finish reason said: the record says `length` (the server's
  word kept in `finish_reason_raw`). Below the budget it is a broken tool call.
- An answer asked to be JSON (`response_format`, a schema, Ollama's `format`) whose content does not
  parse is not whole.

The text is kept only for such requests, bounded (`stream_tally.AnswerTexts`), let go once checked,
and never logged or stored: the record says only whether, how many, how long.
"""

from __future__ import annotations

import orjson

from proxy.diagnosis.stream_tally import AnswerTexts
from proxy.record import COMPLETE_STOP_REASONS, RequestInfo, ResponseRecord

# Answers that are no answer at all: there is no structure to judge.
_NOT_ANSWERS = frozenset({"not_inference", "not_generated", "rejected", "upstream_error"})


def whole_json(text: str) -> bool:
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError:
        return False
    return True


def _reached_budget(record: ResponseRecord) -> bool:
    output, requested = record.output_tokens, record.requested_max_tokens
    if output is None or requested is None:
        return False
    per_choice = output / record.n if record.n and record.n > 1 else output
    return per_choice >= requested


def judge(record: ResponseRecord, info: RequestInfo, texts: AnswerTexts | None) -> None:
    """`answer_complete` and `incomplete_detail` of a finished record (and its stop, where a tool call
    was cut by the budget the server did not name)."""
    if not (info.tools or info.json_format) or texts is None or record.stop_reason in _NOT_ANSWERS:
        return
    if texts.overflow is not None:
        record.incomplete_detail = f"not checked: {texts.overflow}"
        return
    at_budget = _reached_budget(record)
    calls = {key: "".join(pieces) for key, pieces in texts.tool_calls.items()}
    # A call with no arguments at all is whole, unless the answer ran out where it stood.
    broken = [key for key, text in calls.items()
              if not (whole_json(text) if text.strip() else not (at_budget or record.stop_reason == "length"))]
    if broken:
        record.answer_complete, record.incomplete_part = False, "tool_call"
        said = f"{len(broken)} of {len(calls)} tool call{'s' if len(calls) != 1 else ''}"
        if record.stop_reason == "length":
            record.incomplete_detail = f"{said} ended mid-arguments at the length stop"
        elif at_budget:
            raw = record.finish_reason_raw
            record.incomplete_detail = (f"{said} ended mid-arguments when the output reached the requested budget of "
                                        f"{record.requested_max_tokens:,} tokens: the budget cut the answer, though "
                                        f"the server said {raw!r}")
            record.stop_reason, record.stop_reason_certain = "length", True
            record.length_cause, record.length_cause_source = "requested_budget", "output_count"
        else:
            record.incomplete_detail = (f"{said} ended with arguments that are not whole JSON, below the budget: a "
                                        "broken tool call")
        return
    content = "".join(texts.content.get("0", ()))
    if info.json_format and not calls:
        if whole_json(content):
            record.answer_complete = True
            return
        record.answer_complete, record.incomplete_part = False, "json"
        size = len(content.encode("utf-8", "surrogatepass"))
        if record.stop_reason == "length":
            record.incomplete_detail = f"the answer asked to be JSON was cut by the length stop after {size:,} bytes"
        elif not content.strip():
            record.incomplete_detail = "the answer asked to be JSON is empty"
        else:
            record.incomplete_detail = (f"the answer asked to be JSON is not whole JSON ({size:,} bytes) though the "
                                        f"server said {record.finish_reason_raw!r}")
        return
    # Whole calls in a stream the server ended itself without a reason (vLLM's `finish_reason: null`
    # with tools, vllm#27572) are whole: what the server sent can be used. A break leaves it open.
    ended_by_server = record.stop_reason in COMPLETE_STOP_REASONS or (
        bool(calls) and record.stop_reason == "interrupted")
    record.answer_complete = ended_by_server or None
