"""vLLM (`vllm serve`): an OpenAI-compatible server that never cuts a prompt and never trims a budget.

- Recognized by `GET /v1/models`, whose models it says it owns (`owned_by: "vllm"`), each with its
  `max_model_len` (vllm/entrypoints/openai/serving_models.py).
- Its tokenizer: `POST /tokenize` renders `messages` with the same chat template as its chat route
  (vllm/entrypoints/serve/tokenize/protocol.py, TokenizeChatRequest) and answers `count` and
  `max_model_len`.
- A prompt longer than `max_model_len` is answered 400 (vllm/renderers/params.py, _token_len_check).
- A request's budget is `min(max_tokens, max_model_len - prompt)` (after `truncate_prompt_tokens`);
  a budget larger than the context is a 400, and memory pressure preempts a request, it never trims
  its budget (vllm/entrypoints/serve/utils/api_utils.py, get_max_tokens).
- Metrics: the V0 engine's in vllm/engine/metrics.py, V1's in vllm/v1/metrics/loggers.py. V1 renamed
  gpu_cache_usage_perc to kv_cache_usage_perc (0.9, the old name deprecated); the preemption counter
  is `vllm:num_preemptions_total` (V0) / `vllm:num_preemptions` (V1), which prometheus_client exposes
  as the sample `vllm:num_preemptions_total`. V1 also keeps `vllm:request_num_preemptions`, a
  histogram observed once per finished request with its own preemption count: its sum and count.
"""

from __future__ import annotations

from typing import Any

from proxy.record import LengthCause, RequestInfo, ResponseRecord
from proxy.servers.base import (
    MetricNames,
    PromptCount,
    PromptFinding,
    Server,
    ServerAnswers,
    ServerIdentity,
    ServerInfo,
    SpanNames,
    TokenizerQuery,
    TokenizerUnavailable,
    positive_count,
)
from proxy.wire.dialects.base import as_count

# Its own span of each request it finishes (vllm/v1/engine/output_processor.py, do_tracing; names in
# vllm/tracing/utils.py, SpanAttributes), and its request ids `chatcmpl-<X-Request-Id>`, `cmpl-<...>`
# (vllm/entrypoints/serve/engine/serving.py, _base_request_id).
SPAN_NAMES = SpanNames(
    span="llm_request", request_id="gen_ai.request.id", id_prefixes=("chatcmpl-", "cmpl-"),
    counts={"gen_ai.usage.prompt_tokens": "prompt_tokens", "gen_ai.usage.completion_tokens": "completion_tokens",
            "gen_ai.request.max_tokens": "max_tokens", "gen_ai.request.n": "n"},
    seconds={"gen_ai.latency.time_in_queue": "queue_s", "gen_ai.latency.time_to_first_token": "ttft_s",
             "gen_ai.latency.e2e": "e2e_s", "gen_ai.latency.time_in_model_prefill": "prefill_s",
             "gen_ai.latency.time_in_model_decode": "decode_s"})

# Fields of a chat request that vLLM's chat template sees but /tokenize takes only as template kwargs
# (vllm/entrypoints/openai/chat_completion/protocol.py, build_chat_params).
TEMPLATE_KWARGS = ("documents", "reasoning_effort")
CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
               "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs", "media_io_kwargs")


def models_owner(listing: Any) -> str | None:
    """Whom `GET /v1/models` says owns the models it serves."""
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return None
    owners = {m.get("owned_by") for m in data if isinstance(m, dict)}
    return next((o for o in owners if isinstance(o, str)), None)


def model_contexts(listing: Any, source: str = "vLLM GET /v1/models") -> dict[str, ServerInfo]:
    """Each served model's `max_model_len`, by id."""
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return {}
    found = {}
    for entry in data:
        if isinstance(entry, dict) and isinstance(entry.get("id"), str) and positive_count(entry.get("max_model_len")):
            found[entry["id"]] = ServerInfo(source, entry["max_model_len"])
    return found


def context_in_listing(listing: Any, model: str) -> ServerInfo | None:
    """`model`'s `max_model_len` in a `/v1/models` listing (its only model's when it lists one):
    any server that lists it says the same thing."""
    lengths = model_contexts(listing)
    found = lengths.get(model) or next(iter(lengths.values()), None)
    return ServerInfo("vLLM GET /v1/models", found.context_per_request) if found else None


class VLLM(Server):
    kind = "vllm"
    name = "vLLM"

    def concurrency_switch(self, limit: int) -> str | None:
        return f"--max-num-seqs {limit}"
    telemetry_read = "metrics_text"
    metric_names = MetricNames(
        running=("vllm:num_requests_running",),
        waiting=("vllm:num_requests_waiting",),
        kv_cache_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        preemptions=("vllm:num_preemptions_total", "vllm:num_preemptions"),
        request_preemptions=("vllm:request_num_preemptions_sum",),
        requests_finished=("vllm:request_num_preemptions_count",),
    )

    async def identify(self, answers: ServerAnswers, models: tuple[str, ...]) -> ServerIdentity | None:
        listing = await answers.get_json("/v1/models")
        if models_owner(listing) != "vllm":
            return None
        return ServerIdentity("vllm", None, model_contexts(listing))

    async def context_for(self, answers: ServerAnswers, model: str) -> ServerInfo | None:
        return context_in_listing(await answers.get_json("/v1/models"), model)

    async def count_prompt(self, answers: ServerAnswers, query: TokenizerQuery, request: dict[str, Any],
                           identity: ServerIdentity, headers: dict[str, str]) -> PromptCount:
        """`POST /tokenize` with the request's messages. What the chat route passes its template
        beyond those fields goes in as template kwargs; a tool choice or response format cannot, so
        such a count is approximate."""
        if "messages" in request:
            payload = {k: request[k] for k in CHAT_FIELDS if k in request}
            kwargs = dict(request.get("chat_template_kwargs") or {})
            for name in TEMPLATE_KWARGS:
                if request.get(name) is not None:
                    kwargs.setdefault(name, request[name])
            if request.get("reasoning_effort") is not None:
                kwargs.setdefault("enable_thinking", request["reasoning_effort"] != "none")
            if kwargs:
                payload["chat_template_kwargs"] = kwargs
            exact = "response_format" not in request and request.get("tool_choice") in (None, "auto", "none")
        else:
            prompt = request.get("prompt")
            if isinstance(prompt, list) and prompt and all(as_count(t) is not None for t in prompt):
                return PromptCount(len(prompt), identity.context_for(query.model), "the request's own token ids")
            if not isinstance(prompt, str):
                raise TokenizerUnavailable("a batch of prompts is not counted", "unavailable")
            payload = {"prompt": prompt, "add_special_tokens": request.get("add_special_tokens", True)}
            exact = True
        if query.model is not None:
            payload["model"] = query.model
        answer = await answers.post_json("/tokenize", payload, headers)
        count = as_count(answer.get("count")) if isinstance(answer, dict) else None
        context = as_count(answer.get("max_model_len")) if isinstance(answer, dict) else None
        if count is None:  # (a negative or absurd count is none)
            raise TokenizerUnavailable("POST /tokenize answered without a count")
        return PromptCount(count, (context if context else None) or identity.context_for(query.model),
                           "vLLM POST /tokenize", exact)

    def prompt_truncation(self, record: ResponseRecord, info: RequestInfo, identity: ServerIdentity) -> PromptFinding:
        if info.truncate_prompt_tokens is not None:
            return PromptFinding(None, f"the client asked vLLM to keep only the last {info.truncate_prompt_tokens} "
                                       "prompt tokens; its count does not show whether it had more")
        return PromptFinding(False, "vLLM answers a prompt longer than max_model_len with a 400; it never cuts "
                                    "one (vllm/renderers/params.py, _token_len_check)")

    def length_cause(self, prompt: int, requested: int, context: int, said: str) -> tuple[LengthCause, str]:
        if prompt + requested > context:
            return "server_limit", (f"{said} > max_model_len {context:,}: vLLM cut the budget to "
                                    f"{max(context - prompt, 0):,}")
        return "requested_budget", (f"{said} <= max_model_len {context:,}: vLLM gave the whole budget (it preempts "
                                    "under memory pressure, it never trims a budget)")


SERVER = VLLM()
