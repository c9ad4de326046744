"""Naming a server-side length limit: the context, a fixed clamp, or a clamp tied to free capacity."""

from __future__ import annotations

from proxy.record import ResponseRecord
from proxy.servers.base import ServerInfo
from proxy.servers.llamacpp import info_from_props as from_llamacpp_props
from proxy.servers.ollama import loaded_contexts
from proxy.servers.vllm import context_in_listing as from_vllm_models
from proxy.sweep.limits import characterise


def from_ollama_ps(body: object, model: str) -> ServerInfo | None:
    found = loaded_contexts(body)
    return found.get(model) or next(iter(found.values()), None)


def cut(prompt: int, output: int) -> ResponseRecord:
    return ResponseRecord(request_id="r", method="POST", path="/v1/chat/completions", route="/v1/chat/completions",
                          dialect="openai", started_at=0.0, prompt_tokens=prompt, output_tokens=output,
                          stop_reason="length", length_cause="server_limit", requested_max_tokens=400)


def test_prompt_plus_answer_constant_over_varying_prompts_is_the_context() -> None:
    found = characterise([cut(227, 29), cut(200, 56), cut(100, 156)])
    assert found.kind == "context" and found.words == "the context ends at 256 tokens per request (prompt + answer)"


def test_the_servers_slots_make_a_split_visible() -> None:
    """llama-server -c 4096 -np 4: each slot 1,024; one prompt, so only the server can say it is the context."""
    server = ServerInfo("llama.cpp GET /props", 1024, 4)
    found = characterise([cut(1002, 22)] * 3, server)
    assert found.kind == "context"
    assert found.words == ("the context ends at 1,024 tokens per request (prompt + answer) "
                           "(4,096 split over 4 slots = 1,024 each?)")
    assert "1,024 tokens per request, 4 slots (llama.cpp GET /props)" in found.evidence[0]


def test_one_prompt_and_one_length_without_the_servers_word_is_left_open() -> None:
    found = characterise([cut(1002, 22)] * 3)
    assert found.kind == "unclear" and "a context of 1024 tokens, or a clamp to 22" in found.evidence[0]


def test_the_same_answer_length_whatever_the_prompt_is_a_clamp() -> None:
    found = characterise([cut(10, 64), cut(200, 64), cut(90, 64)])
    assert (found.kind, found.words) == ("clamp", "the server clamps every answer to 64 tokens")


def test_answers_that_vary_under_one_prompt_are_a_clamp_by_free_capacity() -> None:
    levels = [(4, [cut(31, 33), cut(31, 65)]), (8, [cut(31, 65), cut(31, 65)])]
    found = characterise([r for _, rs in levels for r in rs], None, levels)
    assert found.kind == "load_clamp" and "median by concurrency: c=4: 65, c=8: 65" in found.evidence[0]


def test_what_each_server_says_of_its_context() -> None:
    assert from_llamacpp_props({"default_generation_settings": {"n_ctx": 1024}, "total_slots": 4}) == ServerInfo(
        "llama.cpp GET /props", 1024, 4)
    assert from_vllm_models({"data": [{"id": "tiny", "max_model_len": 512}]}, "tiny") == ServerInfo(
        "vLLM GET /v1/models", 512)
    assert from_ollama_ps({"models": [{"name": "llama3.2:latest", "model": "llama3.2:latest",
                                       "context_length": 4096}]}, "llama3.2:latest") == ServerInfo(
        "Ollama GET /api/ps", 4096)
    assert from_llamacpp_props({"data": []}) is None and from_vllm_models({"object": "list"}, "m") is None
    assert from_ollama_ps({"models": [{"name": "x"}]}, "x") is None
