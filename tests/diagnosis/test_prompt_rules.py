"""The prompt's fate and a length stop's cause by the server's own numbers: every rule, both ways."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.diagnosis.prompt_rules import APPROXIMATE_SLACK, PromptCount, length_cause_from_prompt, prompt_truncation
from proxy.record import RequestInfo, ResponseRecord
from proxy.servers.base import UNKNOWN_SERVER, ServerIdentity, ServerInfo

OLLAMA = ServerIdentity("ollama", None, {"m": ServerInfo("Ollama GET /api/ps", 2048)}, version="0.33.2")
VLLM = ServerIdentity("vllm", None, {"m": ServerInfo("vLLM GET /v1/models", 512)})
LLAMACPP = ServerIdentity("llamacpp", ServerInfo("llama.cpp GET /props", 256, 4))


def answered(dialect: str = "ollama", **fields: Any) -> ResponseRecord:
    base: dict[str, Any] = {"request_id": "r", "method": "POST", "path": "/api/chat", "route": "/api/chat",
                            "dialect": dialect, "started_at": 0.0, "model": "m", "status": 200, "stop_reason": "eos",
                            "prompt_tokens": 100, "prompt_tokens_source": "usage", "output_tokens": 20,
                            "tokens_source": "usage"}
    base.update(fields)
    return ResponseRecord(**base)


def asked(words: int | None = 50, **fields: Any) -> RequestInfo:
    return RequestInfo(model="m", body_parsed=True, has_prompt=True, user_turn=True, prompt_words=words, **fields)


# --- servers that cut silently: a count below the words sent proves it ------------------------------

def test_ollama_reporting_fewer_prompt_tokens_than_the_words_sent_cut_the_prompt() -> None:
    found = prompt_truncation(answered(prompt_tokens=1026), asked(9000), OLLAMA)
    assert found.truncated is True
    assert found.detail is not None and "1,026 prompt tokens (context 2,048 tokens)" in found.detail


def test_ollama_reporting_at_least_the_words_sent_cannot_be_told_either_way() -> None:
    found = prompt_truncation(answered(prompt_tokens=1026), asked(700), OLLAMA)
    assert found.truncated is None and found.detail is not None and "no tokenizer" in found.detail


def test_the_requests_own_num_ctx_is_the_context_named() -> None:
    found = prompt_truncation(answered(prompt_tokens=130), asked(300, num_ctx=256), OLLAMA)
    assert found.truncated is True and found.detail is not None and "context 256" in found.detail


def test_ollama_0_30_0_counts_no_cached_tokens_so_its_count_proves_nothing() -> None:
    """ollama#16414: 0.30.0 left cache_n out of prompt_eval_count."""
    found = prompt_truncation(answered(prompt_tokens=3), asked(900), ServerIdentity("ollama", version="0.30.0"))
    assert found.truncated is None and found.detail is not None and "0.30.0" in found.detail


def test_ollamas_native_route_names_its_server_before_any_probe() -> None:
    assert prompt_truncation(answered(prompt_tokens=10), asked(50), UNKNOWN_SERVER).truncated is True


def test_a_count_from_a_server_the_proxy_does_not_know_proves_nothing() -> None:
    """A server (or a fake) whose prompt_tokens may be anything: no conclusion from it."""
    record = answered("openai", route="/v1/chat/completions", prompt_tokens=7)
    found = prompt_truncation(record, asked(17), UNKNOWN_SERVER)
    assert found.truncated is None and found.detail is not None and "not one whose" in found.detail


def test_no_count_from_ollama_says_so() -> None:
    found = prompt_truncation(answered(prompt_tokens=None, prompt_tokens_source=None), asked(50), OLLAMA)
    assert found.truncated is None and found.detail is not None and "no prompt count" in found.detail


def test_sglang_cuts_only_with_auto_truncate_and_its_count_shows_it() -> None:
    sglang = ServerIdentity("sglang")
    record = answered("openai", route="/v1/chat/completions", prompt_tokens=10)
    assert prompt_truncation(record, asked(50), sglang).truncated is True
    assert prompt_truncation(record, asked(5), sglang).truncated is None


# --- servers that refuse instead ---------------------------------------------------------------------

def test_vllm_never_cuts_a_prompt_it_refuses_longer_ones() -> None:
    record = answered("openai", route="/v1/chat/completions", prompt_tokens=7)
    found = prompt_truncation(record, asked(50), VLLM)
    assert found.truncated is False and found.detail is not None and "400" in found.detail


def test_vllms_truncate_prompt_tokens_is_the_clients_own_cut_and_not_shown_by_the_count() -> None:
    record = answered("openai", route="/v1/chat/completions", prompt_tokens=64)
    assert prompt_truncation(record, asked(500, truncate_prompt_tokens=64), VLLM).truncated is None


def test_a_refused_prompt_was_not_cut() -> None:
    record = answered(status=400, stop_reason="upstream_error", upstream_error="exceeds_context")
    assert prompt_truncation(record, asked(9000), LLAMACPP).truncated is False


@pytest.mark.parametrize("fields", [{"status": 429, "stop_reason": "rejected"}, {"stop_reason": "not_generated"},
                                    {"status": None, "stop_reason": "upstream_error"}])
def test_no_answer_no_verdict_on_its_prompt(fields: dict[str, Any]) -> None:
    assert prompt_truncation(answered(**fields), asked(9000), OLLAMA).truncated is None


# --- llama.cpp: a context shift is the only cut ------------------------------------------------------

def test_llamacpp_prompt_and_output_past_the_slots_context_is_a_shift() -> None:
    found = prompt_truncation(answered("openai", prompt_tokens=200, output_tokens=100), asked(10), LLAMACPP)
    assert found.truncated is True and found.detail is not None and "shifted" in found.detail


def test_llamacpp_prompt_and_output_within_the_context_is_no_cut() -> None:
    found = prompt_truncation(answered("openai", prompt_tokens=200, output_tokens=54), asked(10), LLAMACPP)
    assert found.truncated is False


def test_llamacpp_at_the_edge_of_its_context_is_read_from_its_flag() -> None:
    edge = {"prompt_tokens": 200, "output_tokens": 55}  # 255 = context - 1: a slot's last token, or a shift
    assert prompt_truncation(answered("llamacpp", **edge, truncated_flag=False), asked(10), LLAMACPP).truncated is False
    assert prompt_truncation(answered("llamacpp", **edge, truncated_flag=None), asked(10), LLAMACPP).truncated is None
    shifted = answered("llamacpp", **edge, truncated_flag=True, stop_reason="eos")
    assert prompt_truncation(shifted, asked(10), LLAMACPP).truncated is True
    # A length stop at the context: without a shift llama.cpp stops when prompt + output + 1 reaches
    # n_ctx (server-context.cpp, "stopped due to running out of context capacity"); a shift would have
    # gone on past it. The context ended the answer, and the prompt was whole.
    ran_out = answered("llamacpp", **edge, truncated_flag=True, stop_reason="length")
    assert prompt_truncation(ran_out, asked(10), LLAMACPP).truncated is False


def test_llamacpp_length_stop_exactly_at_the_slots_context_is_no_prompt_cut() -> None:
    at_context = answered("openai", prompt_tokens=200, output_tokens=56, stop_reason="length")  # 256 = the context
    found = prompt_truncation(at_context, asked(10), LLAMACPP)
    assert found.truncated is False and found.detail is not None and "the context ended it" in found.detail
    ended_alone = answered("openai", prompt_tokens=200, output_tokens=56, stop_reason="eos")
    assert prompt_truncation(ended_alone, asked(10), LLAMACPP).truncated is None


def test_llamacpp_n_keep_minus_one_keeps_the_whole_prompt() -> None:
    found = prompt_truncation(answered("llamacpp", prompt_tokens=200, output_tokens=100), asked(10, n_keep=-1),
                              LLAMACPP)
    assert found.truncated is False


# --- a length stop's cause from the prompt count ------------------------------------------------------

def test_vllm_a_budget_the_context_leaves_room_for_was_given_whole() -> None:
    cause, detail = length_cause_from_prompt("vllm", PromptCount(8, 512, "vLLM POST /tokenize"), 200)
    assert cause == "requested_budget" and "8 tokens" in detail and "512" in detail


def test_vllm_a_budget_past_the_context_was_cut_to_what_it_left() -> None:
    cause, detail = length_cause_from_prompt("vllm", PromptCount(324, 512, "vLLM POST /tokenize"), 300)
    assert cause == "server_limit" and "cut the budget to 188" in detail


def test_vllm_the_boundary_itself_is_the_whole_budget() -> None:
    assert length_cause_from_prompt("vllm", PromptCount(312, 512, "t"), 200)[0] == "requested_budget"
    assert length_cause_from_prompt("vllm", PromptCount(313, 512, "t"), 200)[0] == "server_limit"


def test_vllm_counts_the_prompt_after_the_clients_own_truncation() -> None:
    assert length_cause_from_prompt("vllm", PromptCount(900, 512, "t"), 200, truncate_prompt_tokens=100)[0] == (
        "requested_budget")


def test_an_approximate_count_near_the_context_decides_nothing() -> None:
    near = PromptCount(312, 512, "t", exact=False)
    assert length_cause_from_prompt("vllm", near, 200)[0] == "unknown"
    far = PromptCount(312 - APPROXIMATE_SLACK - 1, 512, "t", exact=False)
    assert length_cause_from_prompt("vllm", far, 200)[0] == "requested_budget"


def test_llamacpp_a_budget_that_ends_before_the_slots_context_was_the_cause() -> None:
    assert length_cause_from_prompt("llamacpp", PromptCount(50, 256, "t"), 205)[0] == "requested_budget"
    cause, detail = length_cause_from_prompt("llamacpp", PromptCount(50, 256, "t"), 206)
    assert cause == "unknown" and "context shift" in detail


def test_no_context_or_no_rule_decides_nothing() -> None:
    assert length_cause_from_prompt("vllm", PromptCount(8, None, "t"), 200)[0] == "unknown"
    assert length_cause_from_prompt("ollama", PromptCount(8, 512, "t"), 200)[0] == "unknown"


# --- Ollama's silent cut, by sound bounds ----------------------------------------------------------
SHOWN = ServerIdentity("ollama", None, {"m": ServerInfo("Ollama GET /api/ps", 2048, template_bytes=300,
                                                        system_bytes=0)}, version="0.33.2")


def chat_info(words: int, size: int | None, messages: int = 1, tools: bool = False) -> RequestInfo:
    return RequestInfo(model="m", has_prompt=True, user_turn=True, prompt_words=words, all_words=words,
                       all_bytes=size, messages=messages, tools=tools)


def test_words_of_every_message_above_the_context_prove_a_cut_whatever_the_count() -> None:
    found = prompt_truncation(answered(prompt_tokens=2048), chat_info(3300, 28_000, 24), SHOWN)
    assert found.truncated is True and "3,300 words" in (found.detail or "")


def test_a_count_below_the_words_of_every_message_proves_a_cut() -> None:
    found = prompt_truncation(answered(prompt_tokens=900), chat_info(1500, 9000, 8), SHOWN)
    assert found.truncated is True and "900 prompt tokens" in (found.detail or "")


def test_bytes_and_the_shown_template_within_the_context_prove_no_cut() -> None:
    found = prompt_truncation(answered(prompt_tokens=10), chat_info(7, 41), SHOWN)
    assert found.truncated is False and "at most 943 tokens" in (found.detail or "")  # 41 + 2 + 3 x 300


def test_between_the_bounds_both_are_said() -> None:
    found = prompt_truncation(answered(prompt_tokens=700), chat_info(600, 3000, 4), SHOWN)
    detail = found.detail or ""
    assert found.truncated is None and "at least 600" in detail and "at most 4,802" in detail
    assert "context 2,048" in detail and "counted 700" in detail


def test_no_upper_bound_with_tools_an_image_or_no_template() -> None:
    for info, identity in ((chat_info(7, 41, tools=True), SHOWN), (chat_info(7, None), SHOWN),
                           (chat_info(7, 41), OLLAMA)):
        found = prompt_truncation(answered(prompt_tokens=10), info, identity)
        assert found.truncated is None and "no upper bound" in (found.detail or "")
