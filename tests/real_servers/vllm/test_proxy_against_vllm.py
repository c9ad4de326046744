"""End to end through the proxy against a real vLLM (CPU build): what it records is what vLLM did.

The model (see conftest) answers every chat with the same 250 tokens, then EOS. Every 10th step of
that answer is a two-byte character spelled as two byte tokens, whose first vLLM streams as
`"content": ""`: so even one stream has fewer text-bearing chunks than tokens, and a stream
without a usage chunk can only be counted from below.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import aiohttp
import openai
import pytest

from proxy.observers.metrics import ProxyMetrics
from proxy.observers.telemetry.samples import SampleRing
from proxy.observers.telemetry.server_metrics import UpstreamPoller, UpstreamState
from proxy.record import ResponseRecord
from tests.real_servers.vllm.conftest import EOS_AFTER
from tests.real_servers.vllm.vllm_server import MAX_MODEL_LEN, SERVED_NAME, VllmServer
from tests.support.proxies import record_for
from tests.support.relay import blocking_relay
from tests.support.tee import ByteTee, first_http_response

pytestmark = pytest.mark.vllm

GREEDY: dict[str, Any] = {"temperature": 0, "seed": 42}
COMPLETION_TOKENS = EOS_AFTER + 1  # vLLM counts the EOS token it generated
LONG_PROMPT = "uba ubi " * 80  # 324 prompt tokens: 188 of the 512-token context remain


def new_id() -> str:
    return uuid.uuid4().hex


def client_for(running: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{running.proxy_url}/v1", api_key="unused", max_retries=0)


async def stream_chat(running: Any, *, max_tokens: int | None, include_usage: bool, prompt: str = "hello",
                      stop: list[str] | None = None, client: openai.AsyncOpenAI | None = None,
                      ) -> tuple[ResponseRecord, int]:
    """One streamed chat with the official client; (the proxy's record, content chunks the client saw).

    Concurrent callers share one `client`: making one costs a TLS context (over 100 ms of CPU
    here), and eight made at once stall the event loop the proxy under test runs on.
    """
    if client is None:
        async with client_for(running) as own:
            return await stream_chat(running, max_tokens=max_tokens, include_usage=include_usage, prompt=prompt,
                                     stop=stop, client=own)
    rid = new_id()
    chunks = 0
    events = await client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, stop=stop,
        stream=True, stream_options={"include_usage": True} if include_usage else None,
        extra_headers={"X-Request-Id": rid}, **GREEDY)
    async for event in events:
        chunks += sum(1 for c in event.choices if c.delta.content)
    return await record_for(running, rid), chunks


async def whole_chat(running: Any, *, max_tokens: int | None, prompt: str = "hello",
                     stop: list[str] | None = None, client: openai.AsyncOpenAI | None = None,
                     ) -> tuple[ResponseRecord, Any]:
    """One chat answered whole; concurrent callers share one `client` (see stream_chat)."""
    if client is None:
        async with client_for(running) as own:
            return await whole_chat(running, max_tokens=max_tokens, prompt=prompt, stop=stop, client=own)
    rid = new_id()
    response = await client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, stop=stop,
        extra_headers={"X-Request-Id": rid}, **GREEDY)
    return await record_for(running, rid), response


async def whole_or_unanswered(running: Any, client: openai.AsyncOpenAI, max_tokens: int) -> ResponseRecord:
    """The record of one whole chat, or of the POST vLLM now and then closes unanswered.

    That close (a pooled connection, at concurrency 8 on two cores; see docs/reliability.md
    section) is answered 502 `upstream_reset`, and the record must say so; it is no cut of an answer.
    """
    rid = new_id()
    try:
        await client.chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=max_tokens,
            extra_headers={"X-Request-Id": rid}, **GREEDY)
    except openai.APIStatusError as exc:
        record = await record_for(running, rid)
        assert (exc.status_code, record.status, record.upstream_error) == (502, 502, "reset"), exc
        return record
    return await record_for(running, rid)


async def vllm_gauge(vllm: VllmServer, name: str, *labels: str) -> float:
    """The sum of a vLLM metric's samples whose labels include each of `labels` (`key="value"`)."""
    async with aiohttp.ClientSession() as session, session.get(f"{vllm.url}/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(label in line for label in labels))


async def until(check: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.05)


async def polled_proxy(proxy_for: Any, vllm: VllmServer) -> Any:
    """A proxy whose poller has already read vLLM's /metrics twice, so requests have a baseline."""
    running = await proxy_for(vllm.url)

    async def polled() -> bool:
        ring = running.telemetry.upstream_ring
        return ring is not None and len(ring) >= 2

    await until(polled)
    return running


# --- how answers end ---------------------------------------------------------------------------

@pytest.mark.parametrize("include_usage", [True, False])
async def test_an_answer_ending_with_eos_is_eos_streamed(vllm: VllmServer, proxy_for: Any,
                                                          include_usage: bool) -> None:
    running = await proxy_for(vllm.url)
    record, chunks = await stream_chat(running, max_tokens=300, include_usage=include_usage)
    assert (record.stop_reason, record.finish_reason_raw, record.status) == ("eos", "stop", 200)
    if include_usage:
        assert (record.output_tokens, record.tokens_source) == (COMPLETION_TOKENS, "usage")
    else:  # the "" chunks of held-back bytes show no text: the count is a lower bound
        assert record.tokens_source == "counted" and record.output_tokens == chunks
        assert chunks < COMPLETION_TOKENS
    assert record.prompt_tokens == (8 if include_usage else None)


async def test_an_answer_ending_with_eos_is_eos_whole(vllm: VllmServer, proxy_for: Any) -> None:
    running = await proxy_for(vllm.url)
    record, response = await whole_chat(running, max_tokens=300)
    assert response.choices[0].finish_reason == "stop"
    assert (record.stop_reason, record.output_tokens, record.tokens_source) == ("eos", COMPLETION_TOKENS, "usage")
    assert record.ttft_s is None or record.ttft_s <= record.duration_s


async def test_a_stop_string_is_a_stop_sequence_named_by_vllm(vllm: VllmServer, proxy_for: Any,
                                                               chain: dict[str, Any]) -> None:
    word = chain["texts"][14]  # reached on the 15th token
    running = await proxy_for(vllm.url)
    record, _ = await stream_chat(running, max_tokens=300, include_usage=True, stop=[word])
    assert (record.stop_reason, record.finish_reason_raw, record.stop_reason_certain) == (
        "stop_sequence", "stop", True)
    assert record.output_tokens is not None and record.output_tokens <= 15
    record, _ = await whole_chat(running, max_tokens=300, stop=[word])
    assert record.stop_reason == "stop_sequence"


@pytest.mark.parametrize("include_usage", [True, False])
async def test_a_stop_at_the_clients_budget_is_never_a_server_limit(vllm: VllmServer, proxy_for: Any,
                                                                      chain: dict[str, Any],
                                                                      include_usage: bool) -> None:
    running = await proxy_for(vllm.url)
    record, _ = await stream_chat(running, max_tokens=40, include_usage=include_usage)
    assert (record.stop_reason, record.finish_reason_raw) == ("length", "length")
    if include_usage:
        assert (record.output_tokens, record.length_cause) == (40, "requested_budget")
    else:  # 40 tokens, but the held-back bytes among them streamed as "": fewer text chunks
        shown = sum(1 for text in chain["texts"][:40] if text)  # at most: a chunk may also carry two tokens
        assert shown < 40 and record.tokens_source == "counted"
        assert record.output_tokens is not None and 0 < record.output_tokens <= shown
        # the count cannot tell; vLLM's own tokenizer and budget rule can: 8 + 40 <= 512
        assert (record.length_cause, record.length_cause_source) == ("requested_budget", "server_tokenizer")
        assert (record.prompt_tokens, record.prompt_tokens_source, record.context_tokens) == (8, "tokenizer", 512)
    assert record.truncation_cause != "server_limit"
    record, _ = await whole_chat(running, max_tokens=40)
    assert (record.length_cause, record.output_tokens) == ("requested_budget", 40)


@pytest.mark.parametrize("include_usage", [True, False])
async def test_eight_concurrent_budget_stops_are_never_server_limits(vllm: VllmServer, proxy_for: Any,
                                                                       include_usage: bool) -> None:
    """The false alarm found on real vLLM: under load one chunk can carry several tokens."""
    running = await proxy_for(vllm.url)
    async with client_for(running) as client:
        results = await asyncio.gather(*(stream_chat(running, max_tokens=200, include_usage=include_usage,
                                                     client=client) for _ in range(8)))
    for record, _ in results:
        assert record.stop_reason == "length"
        assert record.length_cause == "requested_budget"
        assert record.length_cause_source == ("output_count" if include_usage else "server_tokenizer")
        assert record.output_tokens is not None and record.output_tokens <= 200


async def test_a_budget_clamped_to_the_context_without_usage_is_a_server_limit_by_vllms_tokenizer(
        vllm: VllmServer, proxy_for: Any) -> None:
    """The seed's central case, as most clients send it: no usage chunk, only counted tokens."""
    running = await proxy_for(vllm.url)
    record, _ = await stream_chat(running, max_tokens=300, include_usage=False, prompt=LONG_PROMPT)
    assert (record.stop_reason, record.tokens_source) == ("length", "counted")
    assert (record.length_cause, record.length_cause_source) == ("server_limit", "server_tokenizer")
    assert (record.prompt_tokens, record.context_tokens) == (324, MAX_MODEL_LEN)
    assert record.length_cause_detail is not None and "cut the budget to 188" in record.length_cause_detail


async def test_a_server_whose_tokenizer_is_blocked_keeps_the_cause_unknown(vllm: VllmServer, proxy_for: Any) -> None:
    """A relay in front of vLLM that refuses /tokenize: the proxy says why it could not decide."""
    async with blocking_relay(vllm.url, "/tokenize") as relay:
        running = await proxy_for(relay)
        record, _ = await stream_chat(running, max_tokens=40, include_usage=False)
    assert (record.length_cause, record.length_cause_source) == ("unknown", "counted")
    assert record.length_cause_detail is not None and "403" in record.length_cause_detail
    assert record.truncation_cause != "server_limit"


async def test_a_budget_clamped_to_the_context_is_a_server_limit(vllm: VllmServer, proxy_for: Any) -> None:
    """max_tokens 300 with a 324-token prompt: vLLM silently generates only 512 - 324 = 188."""
    running = await proxy_for(vllm.url)
    record, _ = await stream_chat(running, max_tokens=300, include_usage=True, prompt=LONG_PROMPT)
    assert (record.stop_reason, record.length_cause) == ("length", "server_limit")
    assert record.prompt_tokens is not None and record.output_tokens is not None
    assert record.prompt_truncated is False  # vLLM refuses a prompt over max_model_len; it never cuts one
    assert record.prompt_tokens + record.output_tokens == MAX_MODEL_LEN and record.output_tokens < 300
    record, _ = await whole_chat(running, max_tokens=300, prompt=LONG_PROMPT)
    assert (record.length_cause, record.output_tokens) == ("server_limit", MAX_MODEL_LEN - 324)
    record, _ = await whole_chat(running, max_tokens=None, prompt=LONG_PROMPT)  # no budget: the context decided
    assert (record.stop_reason, record.length_cause) == ("length", "server_limit")


@pytest.mark.parametrize("stream", [True, False])
async def test_a_budget_over_the_context_is_a_400_recorded_as_an_http_error(vllm: VllmServer, proxy_for: Any,
                                                                             stream: bool) -> None:
    running = await polled_proxy(proxy_for, vllm)
    rid = new_id()
    async with client_for(running) as client:
        with pytest.raises(openai.BadRequestError) as raised:
            await client.chat.completions.create(
                model=SERVED_NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=600,
                stream=stream, extra_headers={"X-Request-Id": rid})
    assert "max_model_len" in str(raised.value)
    record = await record_for(running, rid)
    assert (record.status, record.stop_reason, record.upstream_error) == (400, "upstream_error", "exceeds_context")
    assert record.upstream_error_detail is not None and "max_model_len=512" in record.upstream_error_detail
    # it never ran: no server figures from the samples around it
    assert (record.kv_cache_usage_max, record.upstream_running_max, record.preemptions_during) == (None, None, None)


# --- the client leaves, the server aborts ------------------------------------------------------

# Past its EOS an answer runs to the context's end: 500 tokens, about 1.2 s of the engine's time.
# A 250-token answer is often generated whole before vLLM's API server sends its first byte
# (seen: the head and all 58 kB at once, 0.6 s after the request), and no abort or client
# leaving can cut it then.
LONGEST_ANSWER = {"max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True}


async def leave_mid_stream(running: Any) -> ResponseRecord:
    """The record of a streamed answer whose client left after a few chunks.

    vLLM (0.32, CPU) sometimes sends nothing of an answer until it has all of it, then the whole at
    once: in runs of up to five answers in a row here, whatever the prompt, the load beside it or the
    core its API server runs on, and ten in a row in one CI run. The client then read an answer, not
    a cut, and the stream goes again, for up to a minute; past that, there was nothing to cut in this
    server's state and the test says so. (That the relay holds nothing back is proved against
    scripted upstreams, whose timing is the test's: tests/e2e.)
    """
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hello"}], "stream": True,
            **LONGEST_ANSWER, **GREEDY}
    give_up = time.monotonic() + 60
    async with aiohttp.ClientSession() as session:
        while True:
            rid = new_id()
            response = await session.post(f"{running.proxy_url}/v1/chat/completions", json=body,
                                          headers={"X-Request-Id": rid})
            got = b""
            while len(got) < 2000:  # past the role chunk: some tokens, a few chunks of them
                more = await response.content.readany()
                if not more:
                    break
                got += more
            response.close()
            record = await record_for(running, rid)
            if record.stop_reason != "length":
                return record
            assert not record.client_disconnected  # it had all come before the client left
            if time.monotonic() > give_up:
                pytest.skip("vLLM sent every answer whole for a minute: nothing could be cut mid-stream")


async def test_a_client_leaving_mid_stream_is_recorded_and_frees_vllms_request(vllm: VllmServer,
                                                                                proxy_for: Any) -> None:
    record = await leave_mid_stream(await proxy_for(vllm.url))
    assert (record.stop_reason, record.client_disconnected, record.disconnect_phase) == (
        "client_disconnect", True, "mid_stream")

    async def freed() -> bool:
        return await vllm_gauge(vllm, "vllm:num_requests_running") == 0

    await until(freed)


def what_the_wire_says(received: bytes) -> tuple[str, str | None, str | None]:
    """(stop_reason, upstream_error, finish_reason_raw) that a stream's own bytes prove."""
    for raw, expected in ((b"abort", ("upstream_error", "abort", "abort")), (b"length", ("length", None, "length")),
                          (b"stop", ("eos", None, "stop"))):
        if b'"finish_reason":"' + raw + b'"' in received:
            return expected
    assert received.endswith(b"data: [DONE]\n\n"), received[-200:]
    return ("interrupted", None, None)  # vLLM aborted before its first token: no reason at all


async def test_a_server_side_abort_is_recorded_as_the_wire_shows_it(vllm: VllmServer, proxy_for: Any) -> None:
    """vLLM's abort endpoint (--enable-scale-out) ends a stream in one of two ways.

    - Mid-answer: a last chunk with finish_reason "abort", an upstream_error.
    - Before the first token: the role chunk, then [DONE], no finish_reason: an interruption.

    vLLM sends a stream's head with its first output, and its engine can run so far ahead of its
    API server that the head comes with the whole answer (seen: eight answers in a row). A warm
    engine can also finish the whole answer before any abort lands (seen: twenty answers in a row
    within the full suite, never alone). So each round sends four answers at once, the longest the
    context allows, which the engine then generates side by side, more slowly, and aborts each
    every 10 ms from when it is sent until it ends; up to ten rounds. Every record must say what
    its wire said, and some abort must land.
    """
    running = await proxy_for(vllm.url)
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hello"}], "stream": True,
            **LONGEST_ANSWER, **GREEDY}

    async def abort_until_cancelled(session: aiohttp.ClientSession, rid: str) -> None:
        # The proxy passed the client's X-Request-Id on, and vLLM names the request after it.
        while True:
            async with session.post(f"{vllm.url}/inference/v1/abort_requests",
                                    json={"request_ids": [f"chatcmpl-{rid}"]}) as aborted:
                assert aborted.status == 200
            await asyncio.sleep(0.01)

    async def aborted_answer(session: aiohttp.ClientSession) -> str:
        rid = new_id()
        aborting = asyncio.create_task(abort_until_cancelled(session, rid))
        try:
            async with session.post(f"{running.proxy_url}/v1/chat/completions", json=body,
                                    headers={"X-Request-Id": rid}) as response:
                received = await response.read()
        finally:
            aborting.cancel()
        record = await record_for(running, rid)
        expected = what_the_wire_says(received)
        assert (record.stop_reason, record.upstream_error, record.finish_reason_raw) == expected
        return expected[0]

    seen: set[str] = set()
    async with aiohttp.ClientSession() as session:
        for _ in range(10):
            seen.update(await asyncio.gather(*(aborted_answer(session) for _ in range(4))))
            if {"upstream_error", "interrupted"} <= seen:
                break
    assert seen & {"upstream_error", "interrupted"}, "the answer always finished before vLLM's abort reached it"


# --- load: preemption without truncation --------------------------------------------------------

async def settled_preemptions(vllm: VllmServer, running: Any) -> float:
    """vLLM's preemption count once it stopped changing, and the proxy's poller has read it.

    vLLM publishes the counter a little after the preemption: a load's count can still rise after
    its answers ended. A record's baseline is the poll before it began; waiting here keeps the
    last load's late count out of the next load's records.
    """
    ring = running.telemetry.upstream_ring
    count = await vllm_gauge(vllm, "vllm:num_preemptions_total")
    while True:
        await asyncio.sleep(0.5)
        again = await vllm_gauge(vllm, "vllm:num_preemptions_total")
        if again == count:
            break
        count = again
    read_at = time.time()

    async def polled() -> bool:
        latest = ring.latest()
        return latest is not None and latest[0] > read_at and latest[1].preemptions_total == count

    await until(polled)
    return count


async def test_eight_concurrent_answers_on_a_tiny_kv_cache_are_preempted_yet_complete(
        vllm: VllmServer, proxy_for: Any) -> None:
    """24 blocks of 32 tokens hold three 260-token answers: the other five wait or are recomputed.

    The answers come whole. Eight streams keep vLLM's API server so busy on two cores that its
    /metrics often answers only once they have all ended, and it publishes the preemption
    counter a step late: then no poll brackets a preemption (seen in CI: five loads in a row).
    """
    running = await polled_proxy(proxy_for, vllm)
    # The load runs again (at most five times) until vLLM preempts and the polls bracket it:
    # - when no poll lands between a preemption and the answers' ends, no record can honestly
    #   claim it;
    # - now and then the same load runs several times slower on this machine and vLLM preempts
    #   nothing (seen: its counter unchanged, all eight answers ending together after 6 s). Then
    #   no record may claim a preemption either;
    # - a load where vLLM closed a connection with a POST on it, unanswered, goes again too.
    for _ in range(5):
        before = await settled_preemptions(vllm, running)
        async with client_for(running) as client:
            records = list(await asyncio.gather(*(whole_or_unanswered(running, client, 300) for _ in range(8))))
        if any(r.status == 502 for r in records):
            continue  # vLLM closed a connection with a request on it: the load goes again
        assert all((r.stop_reason, r.output_tokens) == ("eos", COMPLETION_TOKENS) for r in records)
        claimed = any((r.preemptions_during or 0) > 0 for r in records)
        if await vllm_gauge(vllm, "vllm:num_preemptions_total") == before:
            assert not claimed, "a record claims a preemption vLLM never counted"
            continue
        if claimed:
            break
    else:
        raise AssertionError("in five loads no record carried a preemption vLLM counted")
    assert all(r.preemptions_scope == "server_wide" for r in records if r.preemptions_during is not None)
    assert max(r.kv_cache_usage_max or 0.0 for r in records) >= 0.5  # sampled every 0.1 s: peaks may fall between
    # A record carries the server's figures when a poll landed inside its life; when /metrics
    # stalled through the whole of it, it carries none rather than another moment's.
    ring = running.telemetry.upstream_ring
    for r in records:
        polled = ring.window(r.started_at, r.started_at + r.duration_s, max_age=0.0)
        assert (r.kv_cache_usage_max is not None) == any(s.kv_cache_usage is not None for _, s in polled)
    # the client's connections may open late, after the first answers ended: the peak is what overlapped
    overlap = max(sum(1 for o in records if o.started_at <= r.started_at <= o.started_at + o.duration_s)
                  for r in records)
    assert overlap <= max(r.concurrency_peak for r in records) <= 8


# --- the wire ------------------------------------------------------------------------------------

async def test_body_bytes_reach_the_client_exactly_as_vllm_sent_them(vllm: VllmServer, proxy_for: Any) -> None:
    tee = ByteTee("127.0.0.1", vllm.port)
    tee_url = await tee.start()
    try:
        running = await proxy_for(tee_url, upstream_metrics="off")
        body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 60,
                "stream": True, **GREEDY}
        async with aiohttp.ClientSession(auto_decompress=False) as session, session.post(
                f"{running.proxy_url}/v1/chat/completions", json=body) as response:
            received = await response.read()
        await asyncio.sleep(0.1)
        assert len(tee.from_upstream) == 1
        status_line, _, sent = first_http_response(bytes(tee.from_upstream[0]))
        assert status_line.startswith(b"HTTP/1.1 200") and received == sent
        assert received.count(b'"content":""') >= 6  # the role chunk and the held-back bytes
    finally:
        await tee.close()


async def test_vllms_own_metrics_pass_through_and_the_poller_reads_their_real_names(
        vllm: VllmServer, proxy_for: Any) -> None:
    running = await proxy_for(vllm.url)
    async with aiohttp.ClientSession() as session, session.get(f"{running.proxy_url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", 'finished_reason="repetition"', "vllm:request_num_preemptions_sum"):
        assert name in text
    ring: SampleRing[UpstreamState] = SampleRing(10)
    async with aiohttp.ClientSession() as session:
        poller = UpstreamPoller(running.proxy_url, "auto", 1.0, ProxyMetrics(), ring, session)
        assert await poller.detect() == "metrics_text"
    latest = ring.latest()
    assert latest is not None
    state = latest[1]
    assert state.source == "vllm"
    assert None not in (state.running, state.waiting, state.kv_cache_usage, state.preemptions_total,
                        state.request_preemptions_total, state.requests_finished_total)


async def test_vllm_does_not_count_aborts_the_proxy_does(vllm: VllmServer, proxy_for: Any) -> None:
    """A client leaving does not move vLLM's finished_reason="abort" counter; the proxy records it."""
    before = await vllm_gauge(vllm, "vllm:request_success_total", 'finished_reason="abort"')
    record = await leave_mid_stream(await proxy_for(vllm.url))
    assert record.stop_reason == "client_disconnect"
    await asyncio.sleep(0.5)
    after = await vllm_gauge(vllm, "vllm:request_success_total", 'finished_reason="abort"')
    assert after == before


# --- Anthropic Messages and OpenAI Responses, which vLLM 0.32 serves too ------------------------

@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_messages_through_the_official_client(vllm: VllmServer, proxy_for: Any,
                                                               chain: dict[str, Any], stream: bool) -> None:
    import anthropic

    running = await proxy_for(vllm.url)
    cases = ((300, "hello", None, ("eos", None)), (40, "hello", None, ("length", "requested_budget")),
             (300, LONG_PROMPT, None, ("length", "server_limit")),
             (300, "hello", [chain["texts"][14]], ("stop_sequence", None)))
    client = anthropic.AsyncAnthropic(base_url=running.proxy_url, api_key="unused", max_retries=0)
    for budget, prompt, stop, expected in cases:
        rid = new_id()
        kwargs: dict[str, Any] = {"model": SERVED_NAME, "max_tokens": budget, "extra_headers": {"X-Request-Id": rid},
                                  "messages": [{"role": "user", "content": prompt}]}
        if stop:
            kwargs["stop_sequences"] = stop
        if stream:
            async with client.messages.stream(**kwargs) as events:
                final = await events.get_final_message()
        else:
            final = await client.messages.create(**kwargs)
        record = await record_for(running, rid)
        assert (record.dialect, record.stop_reason, record.length_cause) == ("anthropic", *expected), final
        assert (record.output_tokens, record.tokens_source) == (final.usage.output_tokens, "usage")
    await client.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_responses_through_the_official_client(vllm: VllmServer, proxy_for: Any, stream: bool) -> None:
    """vLLM says `incomplete` for a spent budget, and sends incomplete_details: its `completed` is proof."""
    running = await proxy_for(vllm.url)
    async with client_for(running) as client:
        for budget, expected in ((300, ("eos", None)), (40, ("length", "requested_budget"))):
            rid = new_id()
            if stream:
                events = await client.responses.create(model=SERVED_NAME, input="hello", max_output_tokens=budget,
                                                       stream=True, extra_headers={"X-Request-Id": rid})
                async for _ in events:
                    pass
            else:
                await client.responses.create(model=SERVED_NAME, input="hello", max_output_tokens=budget,
                                              extra_headers={"X-Request-Id": rid})
            record = await record_for(running, rid)
            assert (record.dialect, record.stop_reason, record.length_cause, record.stop_reason_certain) == (
                "responses", *expected, True)
            assert record.tokens_source == "usage"
            assert (record.ttft_s is not None) == stream
