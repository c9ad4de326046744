"""What a server-side length limit is, in the words an operator acts on: a context, or a budget clamp.

Pure rules over the records of the length stops before the budget (`length:server_limit`):
- prompt + answer the same number of tokens every time (or what the server says one request's
  context is): the **context** ends there;
- the answer the same length while prompts vary, or a fixed length the context does not explain:
  the server **clamps the budget**;
- the answer's length varying while the prompt stays the same: a clamp **tied to free capacity**.
What the server says of its context (`ServerInfo`) names the number and the slots that share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from proxy.record import ResponseRecord
from proxy.servers.base import ServerInfo

LimitKind = Literal["context", "clamp", "load_clamp", "unclear"]
# Tokens of slack when comparing a sum with the server's context (a template's trailing token).
CONTEXT_SLACK = 2


@dataclass(frozen=True, slots=True)
class LimitFinding:
    kind: LimitKind
    words: str  # for the headline
    evidence: tuple[str, ...]


def _spread(values: Sequence[int]) -> int:
    return max(values) - min(values) if values else 0


def characterise(records: Sequence[ResponseRecord], server: ServerInfo | None = None,
                 levels: Sequence[tuple[int, Sequence[ResponseRecord]]] = ()) -> LimitFinding:
    """Name the limit behind `records` (length stops before the budget); `levels` are the same
    records by concurrency, lowest first, to show their lengths level by level."""
    outputs = [r.output_tokens for r in records if r.output_tokens is not None]
    sums = [r.prompt_tokens + r.output_tokens for r in records
            if r.prompt_tokens is not None and r.output_tokens is not None]
    prompts = [r.prompt_tokens for r in records if r.prompt_tokens is not None]
    told = f"; the server says {server.describe()}" if server is not None else ""
    split = server.split_hint() if server is not None else None
    context = server.context_per_request if server is not None else None
    if sums and _spread(sums) <= CONTEXT_SLACK and (_spread(prompts) > 0 or (context is not None
                                                   and abs(max(sums) - context) <= CONTEXT_SLACK)):
        total = max(sums)
        words = f"the context ends at {total:,} tokens per request (prompt + answer)"
        if split is not None:
            words += f" ({split})"
        return LimitFinding("context", words, (
            f"prompt + output tokens was {total:,} in all {len(sums)} of these{told}",))
    if prompts and _spread(prompts) == 0 and _spread(outputs) > 0:
        by_level = ", ".join(f"c={level}: {median:g}" for level, median in _medians(levels))
        return LimitFinding("load_clamp", "the server clamps the answer budget by its free capacity", (
            f"the prompt stayed {prompts[0]:,} tokens while the answers stopped at {min(outputs):,}-"
            f"{max(outputs):,} (median by concurrency: {by_level}): not a fixed context but a budget "
            f"that varies with the free capacity{told}",))
    if outputs and _spread(outputs) == 0:
        fixed = outputs[0]
        if _spread(prompts) > 0 or context is not None:
            return LimitFinding("clamp", f"the server clamps every answer to {fixed:,} tokens", (
                f"all {len(outputs)} stopped at {fixed:,} output tokens"
                + (" whatever the prompt" if _spread(prompts) > 0 else "") + told,))
        return LimitFinding("unclear", f"every answer stops at {fixed:,} tokens (prompt + answer = {sums[0]:,})"
                            if sums else f"every answer stops at {fixed:,} tokens", (
            f"all {len(outputs)} stopped at {fixed:,} output tokens after the same prompt: a context of "
            f"{sums[0] if sums else '?'} tokens, or a clamp to {fixed:,}; the server does not say its context",))
    return LimitFinding("unclear", "a server-side length limit", (
        f"output tokens {min(outputs, default=0)}-{max(outputs, default=0)}, prompt + output "
        f"{min(sums, default=0)}-{max(sums, default=0)}: neither one context nor one clamp{told}",))


def _medians(levels: Sequence[tuple[int, Sequence[ResponseRecord]]]) -> list[tuple[int, float]]:
    """The median output tokens at each level."""
    medians: list[tuple[int, float]] = []
    for level, records in levels:
        outputs = sorted(r.output_tokens for r in records if r.output_tokens is not None)
        if outputs:
            medians.append((level, float(outputs[len(outputs) // 2])))
    return medians
