"""Counts and sizes from a client or a server are checked for range before they reach a rule: a
negative or absurd one is not said, and the record says it left it out (`values_ignored`). And a
prompt's words are counted only from the parts the server reads as text."""

from __future__ import annotations

import orjson

from proxy.diagnosis.prompt_rules import length_cause_from_prompt
from proxy.diagnosis.recorder import Recorder, read_request
from proxy.diagnosis.server_check import ServerTokenizer
from proxy.servers.base import ServerIdentity, ServerInfo
from proxy.servers.vllm import context_in_listing as from_vllm_models
from proxy.servers.vllm import model_contexts as vllm_contexts
from proxy.wire.dialects import dialect_named

OLLAMA = ServerIdentity("ollama", None, {"m": ServerInfo("Ollama GET /api/ps", 2048)}, version="0.33.2")


def ollama_answer(prompt_eval_count: object, num_ctx: object = None) -> object:
    recorder = Recorder.start("r", "POST", "/api/chat", started=0.0)
    options = {} if num_ctx is None else {"num_ctx": num_ctx}
    recorder.request_body(orjson.dumps({"model": "m", "stream": False, "options": options,
                                        "messages": [{"role": "user", "content": "one two three four five"}]}))
    recorder.response_head(200, "application/json")
    recorder.chunk(orjson.dumps({"model": "m", "message": {"role": "assistant", "content": "hi"}, "done": True,
                                 "done_reason": "stop", "prompt_eval_count": prompt_eval_count, "eval_count": 1}), 0.1)
    return recorder.finish(0.2, server=OLLAMA)


def test_a_negative_prompt_count_proves_no_cut_and_is_said_left_out() -> None:
    record = ollama_answer(-5)
    assert record.prompt_tokens is None and record.prompt_truncated is not True  # -5 < 5 words proved a "cut"
    assert record.values_ignored == "prompt_eval_count=-5"


def test_a_clients_num_ctx_of_minus_one_is_no_context() -> None:
    record = ollama_answer(40, num_ctx=-1)
    assert record.context_tokens == 2048 and record.num_ctx is None  # the server's own, not -1
    assert "num_ctx=-1" in (record.values_ignored or "")


def test_a_server_context_of_minus_five_decides_nothing() -> None:
    assert vllm_contexts({"data": [{"id": "m", "owned_by": "vllm", "max_model_len": -5}]}) == {}
    assert from_vllm_models({"data": [{"id": "m", "owned_by": "vllm", "max_model_len": 2**70}]}, "m") is None


async def test_a_tokenizer_count_of_minus_100000_decides_nothing() -> None:
    """A negative count decided `requested_budget` (prompt + budget below any context)."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from proxy.servers.base import TokenizerQuery, TokenizerUnavailable

    async def tokenize(request: web.Request) -> web.Response:
        return web.json_response({"count": -100_000, "max_model_len": -5})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        import aiohttp

        query = TokenizerQuery("openai", "/v1/chat/completions", "m", orjson.dumps({"model": "m", "messages": []}),
                               40, None)
        async with aiohttp.ClientSession() as session:
            try:
                await ServerTokenizer(session, str(server.make_url("")).rstrip("/")).count(
                    query, ServerIdentity("vllm", None, {}))
            except TokenizerUnavailable as exc:
                assert "without a count" in str(exc)
            else:
                raise AssertionError("a negative count was taken")
    finally:
        await server.close()


def test_a_budget_rule_never_sees_a_context_it_cannot_hold() -> None:
    from proxy.diagnosis.prompt_rules import PromptCount

    cause, _ = length_cause_from_prompt("vllm", PromptCount(10, None, "t"), 40)
    assert cause == "unknown"


def test_words_in_a_part_the_server_does_not_read_as_text_are_not_counted() -> None:
    """Ollama's OpenAI layer reads `text` from parts of type text only (openai/openai.go,
    FromChatRequest): a `text` in an image_url part bounds nothing, and 302 words there proved a cut."""
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}, "text": "word " * 302},
        {"text": "no type at all " * 10}]}]})
    info = read_request(dialect_named("openai"), body)
    assert info.prompt_words == 3
