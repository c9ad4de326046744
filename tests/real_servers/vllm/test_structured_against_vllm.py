"""Structured output and tools through the proxy against the real vLLM (CPU build), with the official
`openai` client. The tiny test model writes nothing a tool parser reads (`--enable-auto-tool-choice`
needs a model trained to call tools), so the tool call here is a named `tool_choice`: vLLM then makes
the arguments with its structured-output backend, as JSON of the tool's parameters, and only the
budget can stop them before they close (vllm/entrypoints/openai/chat_completion, named tool choice)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.real_servers.vllm.vllm_server import SERVED_NAME, VllmServer
from tests.support.proxies import record_for

PARAMETERS = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
TOOLS: Any = [{"type": "function", "function": {"name": "answer", "parameters": PARAMETERS}}]
CHOICE: Any = {"type": "function", "function": {"name": "answer"}}
SCHEMA: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": PARAMETERS}}


@pytest.fixture(scope="module")
def vllm_tools(tmp_path_factory: pytest.TempPathFactory, vllm_model: Path) -> Iterator[VllmServer]:
    """A server of its own: a named tool_choice needs a tool parser set, and vLLM sets one only with
    auto tool choice (vllm/parser/parser_manager.py). The parser also holds back streamed text that
    might open a tool call, which would change the wire the other tests check byte for byte."""
    server = VllmServer(vllm_model, ("--enable-auto-tool-choice", "--tool-call-parser", "pythonic"))
    server.start(tmp_path_factory.mktemp("vllm-tools") / "vllm.log")
    try:
        yield server
    finally:
        server.stop()


def client(running: Any, request_id: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{running.proxy_url}/v1", api_key="unused", max_retries=0,
                              default_headers={"X-Request-Id": request_id})


async def test_a_named_tool_call_cut_by_max_tokens_is_a_length_stop_not_whole(vllm_tools: VllmServer,
                                                                              proxy_for: Any) -> None:
    running = await proxy_for(vllm_tools.url)
    rid = f"vllm-tool-{uuid.uuid4().hex[:8]}"
    await client(running, rid).chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "hello"}], tools=TOOLS, tool_choice=CHOICE,
        max_tokens=2, temperature=0)
    record = await record_for(running, rid)
    assert (record.stop_reason, record.length_cause, record.answer_complete, record.incomplete_part) == (
        "length", "requested_budget", False, "tool_call")


async def test_json_schema_cut_by_max_tokens_and_with_room_to_close(vllm: VllmServer, proxy_for: Any) -> None:
    running = await proxy_for(vllm.url)
    cut, whole = f"vllm-json-{uuid.uuid4().hex[:8]}", f"vllm-json-{uuid.uuid4().hex[:8]}"
    for rid, budget in ((cut, 2), (whole, 64)):
        await client(running, rid).chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": "hello"}], response_format=SCHEMA,
            max_tokens=budget, temperature=0)
    cut_record, whole_record = await record_for(running, cut), await record_for(running, whole)
    assert (cut_record.stop_reason, cut_record.answer_complete, cut_record.incomplete_part) == ("length", False, "json")
    assert (whole_record.stop_reason, whole_record.answer_complete) == ("eos", True)
