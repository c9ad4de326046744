"""llama.cpp's server (`llama-server`): fixed slots, each with its share of the context.

- Recognized by `GET /props`: `default_generation_settings.n_ctx` (the context one slot gets) and
  `total_slots` (tools/server/server-context.cpp, get_res_props). In router mode (`--models-dir`) the
  bare `/props` says `role: router` with an `n_ctx` of 0, and each model's own answer is behind
  `?model=NAME` (tools/server/server-models.cpp, get_router_props); `autoload=false` keeps a state read
  from loading a model that is not running. Its `/v1/models` says each model's `status.value`.
- Its tokenizer: a chat request counted whole, tools and template included, at
  `POST /v1/chat/completions/input_tokens` (server-context.cpp, handle_count_tokens); a `/completion`
  prompt at `POST /tokenize` with the special tokens it adds.
- A prompt longer than a slot's context is refused ("exceeds the available context size"); a prompt
  is only ever cut by a context shift while generating: when prompt + output reach the slot's context
  it drops tokens after `n_keep` (0 by default: the head of the prompt) to go on. Without a shift a
  slot stops one token short of its context.
- Its native route `/completion` (the `llamacpp` dialect) names it before it answers anything.
- Metrics (`--metrics`): `llamacpp:requests_processing`, `llamacpp:requests_deferred`; recent builds
  dropped `kv_cache_usage_ratio`, so it may be absent.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from proxy.record import LengthCause, RequestInfo, ResponseRecord
from proxy.servers.base import (
    MetricNames,
    PromptCount,
    PromptFinding,
    Server,
    ServerAnswers,
    ServerIdentity,
    ServerInfo,
    TokenizerQuery,
    TokenizerUnavailable,
    positive_count,
)
from proxy.wire.dialects.base import as_count

ROUTER_MODELS_MAX = 16  # a router's models asked about, at most
CHAT_ROUTES = ("/v1/chat/completions", "/chat/completions")


def info_from_props(body: Any) -> ServerInfo | None:
    if not isinstance(body, dict) or "total_slots" not in body:
        return None
    settings = body.get("default_generation_settings")
    n_ctx = positive_count(settings.get("n_ctx")) if isinstance(settings, dict) else None
    return ServerInfo("llama.cpp GET /props", n_ctx, positive_count(body.get("total_slots")))


def is_router(props: Any) -> bool:
    """The bare `/props` of llama-server in router mode."""
    return isinstance(props, dict) and props.get("role") == "router"


def loaded_models(listing: Any) -> list[str]:
    """The models a router runs now (its `/v1/models` with each one's `status.value`)."""
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return []
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)
            and isinstance(m.get("status"), dict) and m["status"].get("value") == "loaded"]


def model_query(model: str) -> str:
    """A router's state read of one model, which never loads it."""
    return f"?model={quote(model, safe='')}&autoload=false"


class LlamaCpp(Server):
    kind = "llamacpp"
    name = "llama.cpp"

    def concurrency_switch(self, limit: int) -> str | None:
        return f"-np {limit} (--parallel)"
    native_dialects = ("llamacpp",)
    telemetry_read = "metrics_text"
    metric_names = MetricNames(
        running=("llamacpp:requests_processing",),
        waiting=("llamacpp:requests_deferred",),
        kv_cache_usage=("llamacpp:kv_cache_usage_ratio",),
        preemptions=(),
    )

    async def identify(self, answers: ServerAnswers, models: tuple[str, ...]) -> ServerIdentity | None:
        props = await answers.get_json("/props")
        if is_router(props):
            names = dict.fromkeys([*loaded_models(await answers.get_json("/v1/models")), *models])
            by_model = {}
            for model in list(names)[:ROUTER_MODELS_MAX]:
                info = info_from_props(await answers.get_json("/props" + model_query(model)))
                if info is not None:
                    by_model[model] = info
            return ServerIdentity("llamacpp", None, by_model, router=True)
        info = info_from_props(props)
        return ServerIdentity("llamacpp", info) if info is not None else None

    async def context_for(self, answers: ServerAnswers, model: str) -> ServerInfo | None:
        props = await answers.get_json("/props")
        if is_router(props):
            props = await answers.get_json("/props" + model_query(model))
        return info_from_props(props)

    async def count_prompt(self, answers: ServerAnswers, query: TokenizerQuery, request: dict[str, Any],
                           identity: ServerIdentity, headers: dict[str, str]) -> PromptCount:
        suffix = "?autoload=false" if identity.router else ""
        context = identity.context_for(query.model)
        if query.route in CHAT_ROUTES:
            answer = await answers.post_json(query.route + "/input_tokens" + suffix, query.body, headers)
            count = as_count(answer.get("input_tokens")) if isinstance(answer, dict) else None
            if count is None:
                raise TokenizerUnavailable(f"POST {query.route}/input_tokens answered without input_tokens")
            return PromptCount(count, context, f"llama.cpp POST {query.route}/input_tokens")
        prompt = request.get("prompt")
        if not isinstance(prompt, str):
            raise TokenizerUnavailable("only a text prompt is counted", "unavailable")
        payload: dict[str, Any] = {"content": prompt, "add_special": True, "parse_special": True}
        if query.model is not None:
            payload["model"] = query.model
        answer = await answers.post_json("/tokenize" + suffix, payload, headers)
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list):
            raise TokenizerUnavailable("POST /tokenize answered without tokens")
        return PromptCount(len(tokens), context, "llama.cpp POST /tokenize")

    def prompt_truncation(self, record: ResponseRecord, info: RequestInfo, identity: ServerIdentity) -> PromptFinding:
        """Prompt + output past the slot's context proves a shift; `truncated` on /completion says a
        shift happened, or that the context ran out (a length stop)."""
        if info.n_keep is not None and info.n_keep < 0:
            return PromptFinding(False, "n_keep -1: a context shift keeps the whole prompt")
        context = identity.context_for(record.model)
        prompt = record.prompt_tokens if record.prompt_tokens_source == "usage" else None
        output = record.output_tokens if record.tokens_source == "usage" else None
        if prompt is not None and output is not None and context is not None:
            total = prompt + output
            if total > context:
                return PromptFinding(True, f"prompt {prompt:,} + output {output:,} tokens ran past the slot's "
                                           f"context of {context:,}: llama.cpp shifted its context, dropping the "
                                           "oldest prompt tokens")
            if total <= context - 2:
                return PromptFinding(False, f"prompt {prompt:,} + output {output:,} tokens stayed within the slot's "
                                            f"context of {context:,}: no context shift, and llama.cpp refuses a "
                                            "longer prompt")
            if record.stop_reason == "length":
                return PromptFinding(False, f"prompt {prompt:,} + output {output:,} tokens reached the slot's "
                                            f"context of {context:,} and the answer stopped there for length: the "
                                            "context ended it, no shift went on past it, and llama.cpp refuses a "
                                            "longer prompt")
        if record.truncated_flag is False:
            return PromptFinding(False, "llama.cpp says truncated: false (no context shift), and it refuses a prompt "
                                        "longer than a slot's context")
        if record.truncated_flag is True and record.stop_reason != "length":
            return PromptFinding(True, "llama.cpp says truncated: true and the answer went on to its own end: it "
                                       "shifted its context, dropping the oldest prompt tokens")
        return PromptFinding(None, "llama.cpp's counts, or the slot's context, do not tell")

    def length_cause(self, prompt: int, requested: int, context: int, said: str) -> tuple[LengthCause, str]:
        """A slot stops when prompt + output + 1 reaches its context, unless a context shift goes on
        past it (server-context.cpp): a budget that ends first was the cause."""
        if prompt + requested <= context - 1:
            return "requested_budget", f"{said} < the slot's context {context:,}: the budget ends first"
        return "unknown", (f"{said} reaches the slot's context {context:,}: the context ends it first, unless a "
                           "context shift goes on past it, and llama.cpp does not say which")


SERVER = LlamaCpp()
