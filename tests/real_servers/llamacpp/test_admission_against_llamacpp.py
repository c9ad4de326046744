"""The proxy's admission gate in front of a real llama-server whose four slots share one unified KV pool
(`--kv-unified`, 512 tokens): two answers that overlap at all exhaust it, and fail with the server's
"Context size has been exceeded". With the gate at 1, four at once all complete, one after another,
each waiting its turn at the proxy."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.real_servers.llamacpp.conftest import EOS_AFTER, UNIFIED_PROMPT
from tests.real_servers.llamacpp.llama_server import LlamaServer
from tests.real_servers.llamacpp.test_proxy_against_llamacpp import BIG_BUDGET, chat, record_of

pytestmark = pytest.mark.llamacpp


@pytest.mark.timeout(180)
async def test_with_the_gate_at_one_every_answer_on_a_unified_pool_completes(eos_unified_server: LlamaServer,
                                                                           proxy_for: Any) -> None:
    running = await proxy_for(eos_unified_server.url, max_in_flight=1)
    results = await asyncio.gather(*(chat(running, BIG_BUDGET, stream=True, prompt=UNIFIED_PROMPT)
                                     for _ in range(4)))
    waits = []
    for rid, finish, chunks, _ in results:
        assert (finish, chunks) == ("stop", EOS_AFTER)
        record = await record_of(running, rid)
        assert (record["stop_reason"], record["queue_time_source"]) == ("eos", "proxy")
        assert record["concurrency_peak"] == 1  # alone at the server, counted from its admission
        waits.append(record["queue_time_s"])
    assert sorted(waits)[-1] > 0  # the last waited for the others
