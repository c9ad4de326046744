"""The prompt's fate and a length stop's cause, decided by the server's own numbers: pure rules.

Two questions the wire alone often leaves open:
- **Was the prompt cut on the way in?** Ollama drops earlier messages (or the head of one long
  prompt) when a conversation passes its context, answers 200, and reports the prompt count after
  the cut; llama.cpp's context shift drops the oldest tokens after `n_keep` to go on generating.
  The answer then ends by EOS and looks complete.
- **Did a length stop come at the client's budget or before it**, when the server sent no count
  (an OpenAI stream without `include_usage`)? The server's own tokenizer counts the prompt, and
  the server's own rule for its budget decides.

Each answer is proven or left open: a count that is only a lower bound concludes only in the
direction it bounds. Each rule names the server source it rests on.
"""

from __future__ import annotations

from proxy.record import LengthCause, RequestInfo, ResponseRecord
from proxy.servers import server_of, server_of_dialect
from proxy.servers.base import (
    APPROXIMATE_SLACK,
    NOT_ASKED,
    PromptCount,
    PromptFinding,
    ServerIdentity,
    context_of,
)

__all__ = ["NOT_ASKED", "PromptCount", "PromptFinding", "context_of", "length_cause_from_prompt", "prompt_truncation",
           "server_limit_detail"]


def _answered(record: ResponseRecord) -> bool:
    status = record.status
    return (status is not None and 200 <= status < 300
            and record.stop_reason not in ("not_inference", "not_generated", "rejected"))


def prompt_truncation(record: ResponseRecord, info: RequestInfo, identity: ServerIdentity) -> PromptFinding:
    """Did the server cut this answer's prompt? From its own prompt count, its context and its rules
    (each server's module: `proxy.servers`). A server's own native route names it before it has
    answered the proxy's questions (Ollama's /api/*, llama.cpp's /completion); a server the proxy
    does not know gives no proof: the proxy does not know what it counts."""
    if record.upstream_error == "exceeds_context":
        return PromptFinding(False, "the server refused the prompt as longer than its context: it did not cut it")
    if not _answered(record):
        return NOT_ASKED
    server = server_of(identity.kind)
    if identity.kind == "unknown":
        server = server_of_dialect(record.dialect) or server
    return server.prompt_truncation(record, info, identity)


def length_cause_from_prompt(kind: str, count: PromptCount, requested: int,
                             truncate_prompt_tokens: int | None = None) -> tuple[LengthCause, str]:
    """The cause of a length stop before a counted total could reach `requested`, by the server's own
    budget rule (its module's `length_cause`) and its tokenizer's prompt count. A count the tokenizer
    could not make exact decides nothing within APPROXIMATE_SLACK of the context."""
    context = count.context
    if context is None:
        return "unknown", f"{count.source} gave no context to compare with"
    prompt = count.tokens
    if truncate_prompt_tokens is not None:
        prompt = min(prompt, context if truncate_prompt_tokens < 0 else truncate_prompt_tokens)
    said = f"prompt {prompt:,} tokens ({count.source}) + budget {requested:,}"
    if not count.exact and abs(prompt + requested - context) <= APPROXIMATE_SLACK:
        return "unknown", (f"{said} is within {APPROXIMATE_SLACK} of the context {context:,}, and the tokenizer could "
                           "not be given every field that shapes the prompt")
    return server_of(kind).length_cause(prompt, requested, context, said)


def server_limit_detail(record: ResponseRecord) -> str:
    """The numbers behind a length stop the server's limit caused (`server_limit`), as the record holds them."""
    output, requested = record.output_tokens, record.requested_max_tokens
    counted = "the server's count" if record.tokens_source == "usage" else "counted"
    source = record.length_cause_source
    if source == "server_finish":
        said = f"the server says its context ended the answer (finish reason {record.finish_reason_raw!r})"
    elif source == "no_budget":
        said = "the request asked for no budget: the server's own limit (its default budget, or the context) ended it"
    elif output is not None and requested is not None:
        said = f"{output:,} output tokens ({counted}) stopped below the requested budget of {requested:,}"
    else:
        said = "the server ended the answer for length before the requested budget"
    prompt, context = record.prompt_tokens, record.context_tokens
    if prompt is not None and output is not None:
        said += f"; prompt {prompt:,} + output {output:,} = {prompt + output:,} tokens"
        if context:
            said += f" of the {context:,}-token context one request gets"
    elif context:
        said += f"; the context one request gets is {context:,} tokens"
    if source == "no_budget" and output is not None and prompt is None:
        said += f"; {output:,} output tokens"
    return said
