"""End to end through the proxy against a real llama-server: what it records is what the server did.

Slot geometry (see conftest): `split_server` has 4 slots of 256 tokens (1024 / 4) and a model
that never samples EOS, so every length stop there is the budget or the context, never chance.
The `eos_*` servers run the model whose chat answers end with EOS after 40 characters: in one
512-token slot they complete; split into 4 slots of 256 they are cut; in a unified 512-token
pool one completes and two at once exhaust it.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from typing import Any

import aiohttp
import openai
import pytest

from tests.real_servers.llamacpp.conftest import EOS_AFTER, EOS_PROMPT, EOS_PROMPT_TOKENS, SLOT_CTX, UNIFIED_PROMPT
from tests.real_servers.llamacpp.llama_server import ALIAS, LlamaServer
from tests.support.tee import ByteTee, first_http_response

pytestmark = pytest.mark.llamacpp

PROMPT = "Tell me about llamas."
MESSAGES: list[Any] = [{"role": "user", "content": PROMPT}]
GREEDY: dict[str, Any] = {"temperature": 0, "seed": 42}
BIG_BUDGET = 400  # more than a 256-token slot can hold, less than the 1024 of a whole context
RECORD_WAIT_S = 10.0
REPETITIONS = 60


async def record_of(running: Any, request_id: str) -> dict[str, Any]:
    """The proxy's record for one request, from the admin API (it is stored just after the last byte)."""
    deadline = time.monotonic() + RECORD_WAIT_S
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(f"{running.admin_url}/api/requests/{request_id}") as resp:
                if resp.status == 200:
                    found: dict[str, Any] = await resp.json()
                    return found
            if time.monotonic() > deadline:
                raise AssertionError(f"no record for {request_id} after {RECORD_WAIT_S} s")
            await asyncio.sleep(0.05)


def new_id() -> str:
    return f"llamacpp-{uuid.uuid4().hex[:12]}"


def client_for(running: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{running.proxy_url}/v1", api_key="unused", max_retries=0)


async def chat(running: Any, max_tokens: int, *, stream: bool, include_usage: bool = False,
               request_id: str | None = None, prompt: str = PROMPT) -> tuple[str, str | None, int, dict[str, Any]]:
    """One chat completion with the official client: (request id, finish_reason, content chunks, usage)."""
    rid = request_id or new_id()
    messages: list[Any] = [{"role": "user", "content": prompt}]
    async with client_for(running) as client:
        if not stream:
            resp = await client.chat.completions.create(
                model=ALIAS, messages=messages, max_tokens=max_tokens, extra_headers={"X-Request-Id": rid},
                **GREEDY)
            assert resp.usage is not None
            return rid, resp.choices[0].finish_reason, -1, resp.usage.model_dump()
        finish: str | None = None
        chunks = 0
        usage: dict[str, Any] = {}
        events = await client.chat.completions.create(
            model=ALIAS, messages=messages, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True} if include_usage else None,
            extra_headers={"X-Request-Id": rid}, **GREEDY)
        async for event in events:
            for choice in event.choices:
                if choice.delta.content:
                    chunks += 1
                if choice.finish_reason is not None:
                    finish = choice.finish_reason
            if event.usage is not None:
                usage = event.usage.model_dump()
        return rid, finish, chunks, usage


async def native_completion(running: Any, n_predict: int, *, stream: bool) -> tuple[str, dict[str, Any]]:
    """llama.cpp's own `/completion`: (request id, the final object the server sent)."""
    rid = new_id()
    body = {"prompt": PROMPT, "n_predict": n_predict, "stream": stream, **GREEDY}
    async with aiohttp.ClientSession() as session, session.post(
        f"{running.proxy_url}/completion", json=body, headers={"X-Request-Id": rid}
    ) as resp:
        assert resp.status == 200
        if not stream:
            return rid, await resp.json()
        final: dict[str, Any] = {}
        async for line in resp.content:
            if line.startswith(b"data: "):
                final = json.loads(line[6:])
        return rid, final


# --- a length stop at the client's own budget ------------------------------------------------


async def test_chat_completion_stopped_at_max_tokens_is_length_at_requested_budget(
    split_server: LlamaServer, proxy_for: Any
) -> None:
    running = await proxy_for(split_server.url)
    rid, finish, _, usage = await chat(running, 8, stream=False)
    assert (finish, usage["completion_tokens"]) == ("length", 8)
    record = await record_of(running, rid)
    assert record["dialect"] == "openai" and record["status"] == 200
    assert record["stop_reason"] == "length"
    assert record["length_cause"] == "requested_budget"
    assert record["finish_reason_raw"] == "length"
    assert record["requested_max_tokens"] == 8
    assert (record["output_tokens"], record["tokens_source"]) == (8, "usage")
    assert record["prompt_tokens"] == usage["prompt_tokens"]


@pytest.mark.parametrize("include_usage", [False, True], ids=["no_usage_chunk", "usage_chunk"])
async def test_streamed_chat_stopped_at_max_tokens_is_length_at_requested_budget(
    split_server: LlamaServer, proxy_for: Any, include_usage: bool
) -> None:
    running = await proxy_for(split_server.url)
    rid, finish, chunks, usage = await chat(running, 8, stream=True, include_usage=include_usage)
    assert (finish, chunks) == ("length", 8)
    record = await record_of(running, rid)
    assert (record["stop_reason"], record["length_cause"]) == ("length", "requested_budget")
    # without a usage chunk, llama-server's own count still arrives: `timings.predicted_n`
    assert (record["output_tokens"], record["tokens_source"]) == (8, "usage")
    if include_usage:
        assert usage["completion_tokens"] == 8
        assert record["prompt_tokens"] == usage["prompt_tokens"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_native_completion_stopped_at_n_predict_is_requested_budget_not_truncated(
    split_server: LlamaServer, proxy_for: Any, stream: bool
) -> None:
    running = await proxy_for(split_server.url)
    rid, final = await native_completion(running, 8, stream=stream)
    assert (final["stop_type"], final["truncated"], final["tokens_predicted"]) == ("limit", False, 8)
    record = await record_of(running, rid)
    assert record["dialect"] == "llamacpp"
    assert (record["stop_reason"], record["length_cause"]) == ("length", "requested_budget")
    assert record["finish_reason_raw"] == "limit"
    assert record["truncated_flag"] is False
    assert record["output_tokens"] == 8


# --- a length stop at the slot's context, long before the budget -----------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_chat_cut_by_the_slot_context_before_max_tokens_is_server_limit(
    split_server: LlamaServer, proxy_for: Any, stream: bool
) -> None:
    running = await proxy_for(split_server.url)
    rid, finish, chunks, usage = await chat(running, BIG_BUDGET, stream=stream, include_usage=stream)
    assert finish == "length"
    if stream:
        assert chunks == usage["completion_tokens"]  # one content chunk per token
    # The server stops when prompt + generated tokens fill the slot: 1024 / 4 = 256.
    assert usage["prompt_tokens"] + usage["completion_tokens"] == SLOT_CTX
    record = await record_of(running, rid)
    assert (record["stop_reason"], record["length_cause"]) == ("length", "server_limit")
    assert record["requested_max_tokens"] == BIG_BUDGET
    assert record["output_tokens"] == usage["completion_tokens"] < BIG_BUDGET


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_native_completion_cut_by_the_slot_context_is_truncated_server_limit(
    split_server: LlamaServer, proxy_for: Any, stream: bool
) -> None:
    running = await proxy_for(split_server.url)
    rid, final = await native_completion(running, BIG_BUDGET, stream=stream)
    assert (final["stop_type"], final["truncated"]) == ("limit", True)
    assert final["tokens_evaluated"] + final["tokens_predicted"] == SLOT_CTX
    record = await record_of(running, rid)
    assert (record["stop_reason"], record["length_cause"]) == ("length", "server_limit")
    assert record["truncated_flag"] is True
    assert record["output_tokens"] == final["tokens_predicted"] < BIG_BUDGET
    assert record["server_timings"]


# --- answers that end on their own (the EOS model), and what the context does to them ----------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_chat_answer_that_ends_with_eos_is_recorded_complete(
    eos_single_server: LlamaServer, proxy_for: Any, stream: bool
) -> None:
    running = await proxy_for(eos_single_server.url)
    rid, finish, chunks, usage = await chat(running, BIG_BUDGET, stream=stream, include_usage=stream, prompt=EOS_PROMPT)
    assert (finish, usage["completion_tokens"]) == ("stop", EOS_AFTER + 1)  # the EOS counts as a token
    assert usage["prompt_tokens"] == EOS_PROMPT_TOKENS
    if stream:
        assert chunks == EOS_AFTER
    record = await record_of(running, rid)
    assert (record["stop_reason"], record["length_cause"]) == ("eos", None)
    assert record["finish_reason_raw"] == "stop"
    assert record["output_tokens"] == EOS_AFTER + 1


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_native_completion_that_ends_with_eos_is_recorded_eos(
    eos_single_server: LlamaServer, proxy_for: Any, stream: bool
) -> None:
    running = await proxy_for(eos_single_server.url)
    rid, final = await native_completion(running, BIG_BUDGET, stream=stream)
    assert (final["stop_type"], final["truncated"]) == ("eos", False)
    record = await record_of(running, rid)
    assert (record["stop_reason"], record["finish_reason_raw"], record["truncated_flag"]) == ("eos", "eos", False)
    assert record["output_tokens"] == final["tokens_predicted"]


async def test_answer_that_completes_in_one_slot_is_cut_when_the_same_context_is_split_into_four(
    eos_single_server: LlamaServer, eos_split_server: LlamaServer, proxy_for: Any
) -> None:
    # One 512-token slot holds the 268 tokens the answer needs; 1024 split into four slots
    # holds 256 each, so every answer stops at the slot's end, concurrent or not.
    single = await proxy_for(eos_single_server.url)
    rid, finish, _, _ = await chat(single, BIG_BUDGET, stream=True, prompt=EOS_PROMPT)
    assert finish == "stop"
    assert (await record_of(single, rid))["stop_reason"] == "eos"

    split = await proxy_for(eos_split_server.url)
    results = await asyncio.gather(
        *(chat(split, BIG_BUDGET, stream=True, include_usage=True, prompt=EOS_PROMPT) for _ in range(4)))
    for rid, finish, _, usage in results:
        assert finish == "length"
        assert usage["prompt_tokens"] + usage["completion_tokens"] == eos_split_server.slot_ctx
        record = await record_of(split, rid)
        assert (record["stop_reason"], record["length_cause"]) == ("length", "server_limit")
        assert record["output_tokens"] < EOS_AFTER


# --- a unified KV pool: only concurrency exhausts it, and then the server errors --------------


async def two_chats_at_once(running: Any, stream: bool) -> tuple[list[str], list[openai.APIError | None]]:
    """Two chats on the unified pool at the same time, each as the official client ends: an error, or none."""
    rids = [new_id() for _ in range(2)]

    async def one(rid: str) -> openai.APIError | None:
        try:
            await chat(running, BIG_BUDGET, stream=stream, request_id=rid, prompt=UNIFIED_PROMPT)
        except openai.APIError as exc:
            return exc
        return None

    return rids, list(await asyncio.gather(*(one(rid) for rid in rids)))


async def test_unified_pool_lets_one_request_complete(eos_unified_server: LlamaServer, proxy_for: Any) -> None:
    running = await proxy_for(eos_unified_server.url)
    rid, finish, chunks, _ = await chat(running, BIG_BUDGET, stream=True, prompt=UNIFIED_PROMPT)
    assert (finish, chunks) == ("stop", EOS_AFTER)
    assert (await record_of(running, rid))["stop_reason"] == "eos"


async def test_streams_that_exhaust_a_unified_pool_are_recorded_with_the_servers_error(
    eos_unified_server: LlamaServer, proxy_for: Any
) -> None:
    # A stream that already sent a token gets HTTP 200 and then `data: {"error": ...}`; one that
    # fails before its first token gets HTTP 500 and a JSON error (the server's rule, to match
    # OpenAI). Which of the two a request gets depends on timing; the record must say which.
    running = await proxy_for(eos_unified_server.url)
    rids, errors = await two_chats_at_once(running, stream=True)
    statuses = []
    for error in errors:
        if error is not None:
            assert "Context size has been exceeded" in str(error)
        # HTTP 500 before any event; the client raises on a `data: {"error": ...}` event after a 200;
        # none: completed, the pool was not exhausted
        statuses.append(error.status_code if isinstance(error, openai.APIStatusError) else 200 if error else 0)
    if 0 in statuses:  # on a loaded machine one request can finish before the other starts
        done = [rid for rid, status in zip(rids, statuses, strict=True) if status == 0]
        assert all((await record_of(running, rid))["stop_reason"] == "eos" for rid in done)
        if len(done) == len(rids):
            pytest.skip("the two requests did not overlap, so the pool was never exhausted")
    for rid, status in zip(rids, statuses, strict=True):
        if status == 0:
            continue
        record = await record_of(running, rid)
        assert (record["status"], record["stop_reason"]) == (status, "upstream_error")
        assert record["upstream_error"] == "context_exhausted"  # mid-stream or as an HTTP 500: the same words
        assert "Context size has been exceeded" in (record["upstream_error_detail"] or "")
        assert (record["output_tokens"], record["tokens_source"]) in ((None, "none"), *(
            (n, "counted") for n in range(EOS_AFTER)))  # none, or a few counted before the error


async def test_non_streamed_requests_failing_on_an_exhausted_unified_pool_are_http_500(
    eos_unified_server: LlamaServer, proxy_for: Any
) -> None:
    running = await proxy_for(eos_unified_server.url)
    rids, errors = await two_chats_at_once(running, stream=False)
    assert [error.status_code if isinstance(error, openai.APIStatusError) else 200 for error in errors] == [500, 500]
    for rid in rids:
        record = await record_of(running, rid)
        assert (record["status"], record["stop_reason"], record["upstream_error"]) == (
            500, "upstream_error", "context_exhausted")
        assert "Context size has been exceeded" in (record["upstream_error_detail"] or "")


# --- transparency ----------------------------------------------------------------------------

BYTE_CASES = {
    "chat_json": ("/v1/chat/completions", {"model": ALIAS, "messages": MESSAGES, "max_tokens": 16, **GREEDY}),
    "chat_sse": ("/v1/chat/completions",
                 {"model": ALIAS, "messages": MESSAGES, "max_tokens": 16, "stream": True, **GREEDY}),
    "completion_json": ("/completion", {"prompt": PROMPT, "n_predict": 16, **GREEDY}),
    "completion_sse": ("/completion", {"prompt": PROMPT, "n_predict": BIG_BUDGET, "stream": True, **GREEDY}),
}


@pytest.mark.parametrize("case", list(BYTE_CASES))
async def test_proxy_delivers_the_exact_body_bytes_the_server_sent(
    split_server: LlamaServer, proxy_for: Any, case: str
) -> None:
    path, body = BYTE_CASES[case]
    tee = ByteTee("127.0.0.1", split_server.port)
    try:
        running = await proxy_for(await tee.start())
        async with aiohttp.ClientSession(auto_decompress=False) as session, session.post(
            running.proxy_url + path, json=body
        ) as resp:
            received = await resp.read()
            status, content_type = resp.status, resp.headers.get("Content-Type")
        await asyncio.sleep(0.1)  # let the tee's relay finish copying
        assert len(tee.from_upstream) >= 1
        status_line, headers, sent = first_http_response(bytes(tee.from_upstream[0]))
    finally:
        await tee.close()
    assert status == 200 and status_line.startswith(b"HTTP/1.1 200")
    assert content_type == headers["content-type"]
    assert len(received) > 0
    assert received == sent


async def test_requests_right_after_a_stream_all_reach_the_server(
    split_server: LlamaServer, proxy_for: Any
) -> None:
    # llama-server closes the connection after each streamed response although it answered
    # `Keep-Alive: timeout=5, max=100` (non-streamed responses keep it open). A proxy that puts
    # that connection back in its pool can send the next request into a closed socket and
    # answer 502 for a request the server never saw; it is a race, hence the repetitions.
    running = await proxy_for(split_server.url)
    statuses: list[int] = []
    async with aiohttp.ClientSession() as session:
        for i in range(REPETITIONS):
            body = {"model": ALIAS, "messages": MESSAGES, "max_tokens": 2, "stream": i % 2 == 0, **GREEDY}
            async with session.post(f"{running.proxy_url}/v1/chat/completions", json=body) as resp:
                await resp.read()
                statuses.append(resp.status)
    assert statuses == [200] * REPETITIONS


async def test_client_disconnect_mid_stream_frees_the_server_slot(
    long_server: LlamaServer, proxy_for: Any
) -> None:
    running = await proxy_for(long_server.url)
    n_predict = long_server.slot_ctx - 100
    before = await predicted_total(long_server)
    rid = new_id()
    body = {"prompt": PROMPT, "n_predict": n_predict, "stream": True, **GREEDY}
    session = aiohttp.ClientSession()
    try:
        resp = await session.post(f"{running.proxy_url}/completion", json=body, headers={"X-Request-Id": rid})
        data_lines = 0
        while data_lines < 3:
            line = await resp.content.readline()
            assert line, "the stream ended before the test walked away"
            data_lines += line.startswith(b"data: ")
        assert await slot_busy(long_server)
        resp.close()  # drop the connection mid-stream
    finally:
        await session.close()
    deadline = time.monotonic() + 20
    while await slot_busy(long_server):
        assert time.monotonic() < deadline, "the server kept generating for a gone client"
        await asyncio.sleep(0.05)
    # Released with far fewer tokens than asked for: cancelled, not finished (no EOS, no ctx limit).
    generated = await predicted_total(long_server) - before
    assert 3 <= generated < n_predict
    record = await record_of(running, rid)
    assert record["stop_reason"] == "client_disconnect"
    assert record["client_disconnected"] is True
    assert record["disconnect_phase"] == "mid_stream"


async def test_a_non_streamed_request_ended_at_the_deadline_closes_the_upstream_connection_at_once(
    long_server: LlamaServer, proxy_for: Any
) -> None:
    """The proxy ends a non-streamed request at its enforced deadline with a 504 and closes its
    connection to the server at once (the server's side is left in CLOSE_WAIT: it got the FIN). This
    llama-server (0.3.36's) does not notice a closed connection while it builds a non-streamed answer:
    the slot goes on to the whole budget, as it does for a client that leaves on its own (a streamed
    request is cancelled at once: the test above). docs/llamacpp.md says which servers notice."""
    running = await proxy_for(long_server.url, deadline_s=0.5, deadline_mode="enforce")
    body = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6000, **GREEDY}
    started = time.monotonic()
    async with aiohttp.ClientSession() as session, session.post(
            f"{running.proxy_url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 504 and (await resp.json())["error"]["type"] == "deadline_exceeded"
    assert time.monotonic() - started < 1.5
    await asyncio.sleep(0.2)
    assert half_closed_by_the_client(long_server.port), "the proxy kept its connection to the server open"
    assert await slot_busy(long_server)  # llama.cpp's own limit, pinned: update the docs when it changes
    deadline = time.monotonic() + 90  # (6,000 tokens: longer on a machine with other work on it)
    while await slot_busy(long_server):  # (the slot is free again for the next test)
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)


def half_closed_by_the_client(port: int) -> bool:
    """Whether a server socket on `port` is in CLOSE_WAIT: its client closed, the server did not."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "08":  # 08: CLOSE_WAIT
                    return True
    return False


async def slot_busy(server: LlamaServer) -> bool:
    async with aiohttp.ClientSession() as session, session.get(f"{server.url}/slots") as resp:
        return any(slot["is_processing"] for slot in await resp.json())


async def predicted_total(server: LlamaServer) -> int:
    async with aiohttp.ClientSession() as session, session.get(f"{server.url}/metrics") as resp:
        text = await resp.text()
    match = re.search(r"^llamacpp:tokens_predicted_total (\d+)", text, re.MULTILINE)
    assert match, text
    return int(match.group(1))


async def test_server_metrics_slots_and_health_are_reachable_through_the_proxy_port(
    split_server: LlamaServer, proxy_for: Any
) -> None:
    running = await proxy_for(split_server.url)
    async with aiohttp.ClientSession() as session:
        rid = new_id()
        async with session.get(f"{running.proxy_url}/metrics", headers={"X-Request-Id": rid}) as resp:
            assert resp.status == 200
            text = await resp.text()
        assert "llamacpp:requests_processing" in text
        assert "llamacpp:tokens_predicted_total" in text
        async with session.get(f"{running.proxy_url}/slots") as resp:
            assert len(await resp.json()) == split_server.parallel
        async with session.get(f"{running.proxy_url}/health") as resp:
            assert await resp.json() == {"status": "ok"}
    record = await record_of(running, rid)
    assert (record["route"], record["stop_reason"]) == ("other", "not_inference")


# --- the Anthropic Messages and OpenAI Responses routes llama-server also serves ---------------

@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_messages_through_the_official_client(
    eos_single_server: LlamaServer, split_server: LlamaServer, proxy_for: Any, stream: bool
) -> None:
    import anthropic

    for server, budget, expected in ((eos_single_server, 400, ("eos", None)),
                                     (split_server, 8, ("length", "requested_budget")),
                                     (split_server, 400, ("length", "server_limit"))):
        running = await proxy_for(server.url)
        rid = new_id()
        client = anthropic.AsyncAnthropic(base_url=running.proxy_url, api_key="unused", max_retries=0)
        if stream:
            # (the anthropic SDK 2 takes no temperature; the tiny model's chain needs none)
            async with client.messages.stream(model=ALIAS, max_tokens=budget, messages=MESSAGES,
                                              extra_headers={"X-Request-Id": rid}) as events:
                final = await events.get_final_message()
        else:
            final = await client.messages.create(model=ALIAS, max_tokens=budget, messages=MESSAGES,
                                                 extra_headers={"X-Request-Id": rid})
        await client.close()
        record = await record_of(running, rid)
        assert (record["dialect"], record["stop_reason"], record["length_cause"]) == ("anthropic", *expected)
        assert (record["output_tokens"], record["tokens_source"]) == (final.usage.output_tokens, "usage")


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_responses_through_the_official_client(
    eos_single_server: LlamaServer, split_server: LlamaServer, proxy_for: Any, stream: bool
) -> None:
    """llama-server says "completed" whatever ended the answer: the record keeps it uncertain."""
    for server, budget, expected in ((eos_single_server, 400, ("eos", None)),
                                     (split_server, 8, ("length", "requested_budget"))):
        running = await proxy_for(server.url)
        rid = new_id()
        async with client_for(running) as client:
            if stream:
                events = await client.responses.create(model=ALIAS, input=PROMPT, max_output_tokens=budget,
                                                       temperature=0, stream=True,
                                                       extra_headers={"X-Request-Id": rid})
                statuses = [event.response.status async for event in events if event.type == "response.completed"]
                assert statuses == ["completed"]
            else:
                response = await client.responses.create(model=ALIAS, input=PROMPT, max_output_tokens=budget,
                                                         temperature=0, extra_headers={"X-Request-Id": rid})
                assert response.status == "completed"
        record = await record_of(running, rid)
        assert (record["dialect"], record["stop_reason"], record["length_cause"]) == ("responses", *expected)
        assert record["stop_reason_certain"] is False
