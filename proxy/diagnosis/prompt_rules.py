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

from dataclasses import dataclass

from proxy.record import LengthCause, RequestInfo, ResponseRecord
from proxy.wire.server_facts import ServerFacts

# When the server's tokenizer was given the prompt without every field that shapes it (a tool
# choice, a response format), its count may differ from the prompt the server built by a few
# tokens: a budget this close to the context is not decided.
APPROXIMATE_SLACK = 64


@dataclass(frozen=True, slots=True)
class PromptFinding:
    """Whether the server cut the prompt (None: cannot know), and how that was decided."""

    truncated: bool | None
    detail: str | None


@dataclass(frozen=True, slots=True)
class PromptCount:
    """The prompt as the server's own tokenizer counted it, and the context it says a request gets."""

    tokens: int
    context: int | None
    source: str  # e.g. "vLLM POST /tokenize"
    exact: bool = True  # False: the tokenizer could not be given every field that shapes the prompt


NOT_ASKED = PromptFinding(None, None)


def _answered(record: ResponseRecord) -> bool:
    status = record.status
    return (status is not None and 200 <= status < 300
            and record.stop_reason not in ("not_inference", "not_generated", "rejected"))


def prompt_truncation(record: ResponseRecord, info: RequestInfo, facts: ServerFacts) -> PromptFinding:
    """Did the server cut this answer's prompt? From its own prompt count, its context and its rules.

    Servers that cut silently (Ollama; SGLang with --allow-auto-truncate) report the prompt count
    after the cut, so a count below the words of the user's own turns proves a cut: every word is
    at least one token. vLLM and llama.cpp refuse an over-long prompt instead, and llama.cpp's
    context shift shows in its own counts. Any other server's count is not taken as proof: the
    proxy does not know what it counts.
    """
    if record.upstream_error == "exceeds_context":
        return PromptFinding(False, "the server refused the prompt as longer than its context: it did not cut it")
    if not _answered(record):
        return NOT_ASKED
    # A server's own native route names it before any probe has: Ollama's /api/*, llama.cpp's /completion.
    native = {"ollama": "ollama", "llamacpp": "llamacpp"}.get(record.dialect)
    kind = native if native is not None and facts.kind == "unknown" else facts.kind
    if kind == "llamacpp":
        return _llamacpp(record, info, facts)
    if kind == "vllm":
        if info.truncate_prompt_tokens is not None:
            return PromptFinding(None, f"the client asked vLLM to keep only the last {info.truncate_prompt_tokens} "
                                       "prompt tokens; its count does not show whether it had more")
        return PromptFinding(False, "vLLM answers a prompt longer than max_model_len with a 400; it never cuts "
                                    "one (vllm/renderers/params.py, _token_len_check)")
    if kind not in ("ollama", "sglang"):
        return PromptFinding(None, "the server is not one whose prompt counts the proxy knows how to read")
    if kind == "ollama" and (facts.version or "").startswith("0.30.0"):
        # Ollama 0.30.0 counted only the prompt tokens it processed, not those it had cached
        # (llm/llama_server.go; fixed in 0.30.1, ollama#16414): its count is no bound on the prompt.
        return PromptFinding(None, "Ollama 0.30.0 leaves cached tokens out of prompt_eval_count, so its count "
                                   "cannot show a cut")
    counted = record.prompt_tokens if record.prompt_tokens_source == "usage" else None
    words = info.prompt_words
    context = context_of(record, info, facts)
    within = f" (context {context:,} tokens)" if context else ""
    if counted is not None and words is not None and counted < words:
        return PromptFinding(True, f"the server evaluated {counted:,} prompt tokens{within}, while the user's turns "
                                   f"alone hold {words:,} words, each at least one token: it cut the prompt")
    seen = (f": it reported {counted:,} prompt tokens{within}, not fewer than the {words:,} words of the user's "
            "turns" if counted is not None and words is not None else ": it reported no prompt count")
    if kind == "ollama":
        return PromptFinding(None, "Ollama cuts an over-long conversation silently, reports its prompt count after "
                                   f"the cut, and has no tokenizer to ask{seen}")
    return PromptFinding(None, f"SGLang cuts a prompt only with --allow-auto-truncate, which it does not report{seen}")


def context_of(record: ResponseRecord, info: RequestInfo, facts: ServerFacts) -> int | None:
    """The context one request gets: the request's own `num_ctx` (Ollama), else the server's word."""
    if info.num_ctx:
        return info.num_ctx
    server = facts.info_for(record.model)
    return server.context_per_request if server is not None else None


def _llamacpp(record: ResponseRecord, info: RequestInfo, facts: ServerFacts) -> PromptFinding:
    """llama.cpp refuses a prompt longer than a slot's context (server-context.cpp: "exceeds the
    available context size"), so a prompt is only ever cut by a context shift while generating: when
    prompt + output reach the slot's context it drops tokens after `n_keep` (0 by default: the head
    of the prompt) to go on. Without a shift a slot stops one token short of its context, so prompt +
    output past the context proves a shift; `truncated` on /completion says a shift happened, or that
    the context ran out (a length stop)."""
    if info.n_keep is not None and info.n_keep < 0:
        return PromptFinding(False, "n_keep -1: a context shift keeps the whole prompt")
    server = facts.info_for(record.model)
    context = server.context_per_request if server is not None else None
    prompt = record.prompt_tokens if record.prompt_tokens_source == "usage" else None
    output = record.output_tokens if record.tokens_source == "usage" else None
    if prompt is not None and output is not None and context is not None:
        total = prompt + output
        if total > context:
            return PromptFinding(True, f"prompt {prompt:,} + output {output:,} tokens ran past the slot's context of "
                                       f"{context:,}: llama.cpp shifted its context, dropping the oldest prompt tokens")
        if total <= context - 2:
            return PromptFinding(False, f"prompt {prompt:,} + output {output:,} tokens stayed within the slot's "
                                        f"context of {context:,}: no context shift, and llama.cpp refuses a longer "
                                        "prompt")
        if record.stop_reason == "length":
            return PromptFinding(False, f"prompt {prompt:,} + output {output:,} tokens reached the slot's context of "
                                        f"{context:,} and the answer stopped there for length: the context ended "
                                        "it, no shift went on past it, and llama.cpp refuses a longer prompt")
    if record.truncated_flag is False:
        return PromptFinding(False, "llama.cpp says truncated: false (no context shift), and it refuses a prompt "
                                    "longer than a slot's context")
    if record.truncated_flag is True and record.stop_reason != "length":
        return PromptFinding(True, "llama.cpp says truncated: true and the answer went on to its own end: it "
                                   "shifted its context, dropping the oldest prompt tokens")
    return PromptFinding(None, "llama.cpp's counts, or the slot's context, do not tell")


def length_cause_from_prompt(facts_kind: str, count: PromptCount, requested: int,
                             truncate_prompt_tokens: int | None = None) -> tuple[LengthCause, str]:
    """The cause of a length stop before a counted total could reach `requested`, by the server's own
    budget rule and its tokenizer's prompt count.

    - vLLM gives a request `min(max_tokens, max_model_len - prompt)` (after `truncate_prompt_tokens`),
      answers a prompt or a budget larger than max_model_len with a 400, and never trims a budget
      under memory pressure: it preempts (vllm/entrypoints/serve/utils/api_utils.py, get_max_tokens).
      So the stop came before the budget exactly when prompt + budget > max_model_len.
    - llama.cpp stops a slot when prompt + output + 1 reaches its context, unless a context shift
      goes on past it (server-context.cpp): a budget that ends first was the cause.
    """
    context = count.context
    if context is None:
        return "unknown", f"{count.source} gave no context to compare with"
    prompt = count.tokens
    if truncate_prompt_tokens is not None:
        prompt = min(prompt, context if truncate_prompt_tokens < 0 else truncate_prompt_tokens)
    total = prompt + requested
    said = f"prompt {prompt:,} tokens ({count.source}) + budget {requested:,}"
    if not count.exact and abs(total - context) <= APPROXIMATE_SLACK:
        return "unknown", (f"{said} is within {APPROXIMATE_SLACK} of the context {context:,}, and the tokenizer could "
                           "not be given every field that shapes the prompt")
    if facts_kind == "vllm":
        if total > context:
            return "server_limit", (f"{said} > max_model_len {context:,}: vLLM cut the budget to "
                                    f"{max(context - prompt, 0):,}")
        return "requested_budget", (f"{said} <= max_model_len {context:,}: vLLM gave the whole budget (it preempts "
                                    "under memory pressure, it never trims a budget)")
    if facts_kind == "llamacpp":
        if total <= context - 1:
            return "requested_budget", f"{said} < the slot's context {context:,}: the budget ends first"
        return "unknown", (f"{said} reaches the slot's context {context:,}: the context ends it first, unless a "
                           "context shift goes on past it, and llama.cpp does not say which")
    return "unknown", f"no budget rule is known for this server ({facts_kind})"


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
