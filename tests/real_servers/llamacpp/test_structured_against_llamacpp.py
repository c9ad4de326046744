"""Structured output through the proxy against the real llama-server, with the official `openai`
client: a `json_schema` answer cut by `max_tokens` is a length stop and `answer_complete: false`;
the same with room to finish is whole JSON, `answer_complete: true`. llama-server turns the schema
into a grammar (common/json-schema-to-grammar.cpp), so the answer can only be JSON of that shape,
and only its budget can stop it before it closes."""

from __future__ import annotations

import json
from typing import Any

import openai

from tests.real_servers.llamacpp.llama_server import ALIAS, LlamaServer
from tests.real_servers.llamacpp.test_proxy_against_llamacpp import GREEDY, new_id, record_of

SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
    "additionalProperties": False}}}


async def structured(running: Any, max_tokens: int) -> tuple[str, str | None, dict[str, Any]]:
    request_id = new_id()
    client = openai.AsyncOpenAI(base_url=f"{running.proxy_url}/v1", api_key="unused", max_retries=0,
                                default_headers={"X-Request-Id": request_id})
    answer = await client.chat.completions.create(  # type: ignore[call-overload]
        model=ALIAS, messages=[{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
        max_tokens=max_tokens, response_format=SCHEMA, **GREEDY)
    choice = answer.choices[0]
    return choice.message.content or "", choice.finish_reason, await record_of(running, request_id)


async def test_a_json_schema_answer_cut_by_max_tokens_is_not_whole(split_server: LlamaServer,
                                                                    proxy_for: Any) -> None:
    running = await proxy_for(split_server.url)
    content, finish, record = await structured(running, 2)
    assert finish == "length"
    assert (record["stop_reason"], record["length_cause"], record["answer_complete"], record["incomplete_part"]) == (
        "length", "requested_budget", False, "json")
    assert content not in (record.get("incomplete_detail") or "")


async def test_the_same_with_room_to_finish_is_whole(split_server: LlamaServer, proxy_for: Any) -> None:
    running = await proxy_for(split_server.url)
    content, finish, record = await structured(running, 64)
    assert finish == "stop" and json.loads(content) in ({"ok": True}, {"ok": False})
    assert (record["stop_reason"], record["answer_complete"]) == ("eos", True)
