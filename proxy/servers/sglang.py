"""SGLang (`python -m sglang.launch_server`): an OpenAI-compatible server that may cut a prompt.

- Recognized by `GET /v1/models`, whose models it says it owns (`owned_by: "sglang"`), each with its
  `max_model_len`, as vLLM's does.
- It refuses a prompt longer than its context, unless it runs with `--allow-auto-truncate`: then it
  cuts the prompt silently and reports the count after the cut (python/sglang/srt/managers/
  tokenizer_manager.py, TokenizerManager._validate_one_request); a count below the words of the
  user's turns proves such a cut.
- Metrics: python/sglang/srt/observability/metrics_collector.py (formerly srt/metrics/collector.py);
  it retracts (preempts) requests under memory pressure and counts them in
  `sglang:num_retracted_requests_total`.
"""

from __future__ import annotations

from proxy.record import RequestInfo, ResponseRecord
from proxy.servers.base import MetricNames, PromptFinding, Server, ServerAnswers, ServerIdentity, silent_cut
from proxy.servers.vllm import model_contexts, models_owner


class SGLang(Server):
    kind = "sglang"
    name = "SGLang"

    def concurrency_switch(self, limit: int) -> str | None:
        return f"--max-running-requests {limit}"
    telemetry_read = "metrics_text"
    metric_names = MetricNames(
        running=("sglang:num_running_reqs",),
        waiting=("sglang:num_queue_reqs",),
        kv_cache_usage=("sglang:token_usage",),
        preemptions=("sglang:num_retracted_requests_total",),
    )

    async def identify(self, answers: ServerAnswers, models: tuple[str, ...]) -> ServerIdentity | None:
        listing = await answers.get_json("/v1/models")
        if models_owner(listing) != "sglang":
            return None
        return ServerIdentity("sglang", None, model_contexts(listing, "SGLang GET /v1/models"))

    def prompt_truncation(self, record: ResponseRecord, info: RequestInfo, identity: ServerIdentity) -> PromptFinding:
        return silent_cut(record, info, identity, "SGLang", "SGLang cuts a prompt only with --allow-auto-truncate, "
                          "which it does not report")

SERVER = SGLang()
