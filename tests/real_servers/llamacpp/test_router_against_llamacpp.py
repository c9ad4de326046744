"""llama-server in router mode (`--models-dir`): its state lives behind `?model=`, and a read must never
load a model. Against the real router: the proxy's probe and state poller, and the sweep, read each
loaded model's `/props` and `/metrics` with `autoload=false`, and nothing of theirs loads one."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from proxy.config import HostPort, ProxyConfig
from proxy.serve.app import start_proxy
from proxy.sweep.runner import SweepPlan, run_sweep
from tests.real_servers.llamacpp.llama_server import BINARY, LlamaServer
from tests.real_servers.llamacpp.test_proxy_against_llamacpp import record_of

pytestmark = pytest.mark.llamacpp
MODEL = "tiny"  # the router names a model after its file


class RouterServer(LlamaServer):
    def argv(self) -> list[str]:
        return [str(BINARY), "--models-dir", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
                "--ctx-size", str(self.ctx_size), "--parallel", str(self.parallel), "--threads", "2", "--metrics"]


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[RouterServer]:
    models = tmp_path_factory.mktemp("models")
    shutil.copy(tiny_model, models / "tiny.gguf")
    server = RouterServer(models, 1024, 2)
    server.start(tmp_path_factory.mktemp("router") / "router.log")
    try:
        yield server
    finally:
        server.stop()


async def status(router: RouterServer) -> str:
    async with aiohttp.ClientSession() as session, session.get(router.url + "/v1/models") as response:
        body: dict[str, Any] = await response.json()
    return str(next(m["status"]["value"] for m in body["data"] if m["id"] == MODEL))


async def test_the_proxy_reads_a_routers_models_without_loading_one_and_their_state_once_loaded(
        router: RouterServer) -> None:
    running = await start_proxy(ProxyConfig(upstream=router.url, listen=HostPort("127.0.0.1", 0),
                                            admin_listen=HostPort("127.0.0.1", 0), gpu_poll_interval_s=0,
                                            upstream_metrics="auto", upstream_metrics_interval_s=0.2,
                                            log_records=False))
    try:
        assert running.check is not None
        for _ in range(300):
            if running.check.identity.kind == "llamacpp":
                break
            await asyncio.sleep(0.01)
        assert running.check.identity.router
        await asyncio.sleep(1.0)  # the poller has tried /metrics a few times
        assert await status(router) == "unloaded", "a read of the proxy's loaded a model"
        rid = "router-1"
        async with openai.AsyncOpenAI(base_url=f"{running.proxy_url}/v1", api_key="x", max_retries=0) as client:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me."}],
                                                 max_tokens=600, extra_headers={"X-Request-Id": rid})
        record = await record_of(running, rid)
        assert (record["stop_reason"], record["length_cause"]) == ("length", "server_limit")
        # the next probe asks the router about the model the request named, and its slot is 512
        running.check.saw_model(MODEL)
        for _ in range(300):
            info = running.check.identity.info_for(MODEL)
            if info is not None:
                break
            await asyncio.sleep(0.02)
        assert info is not None and (info.context_per_request, info.slots) == (512, 2)
        telemetry = running.telemetry
        assert telemetry is not None and telemetry.upstream_poller is not None
        for _ in range(100):
            latest = telemetry.upstream_ring.latest() if telemetry.upstream_ring is not None else None
            if latest is not None and latest[1].source == "llamacpp":
                break
            await asyncio.sleep(0.05)
        assert latest is not None and latest[1].source == "llamacpp" and telemetry.upstream_poller.router
    finally:
        await running.close()


async def test_the_sweep_reads_a_routers_context_for_its_model(router: RouterServer) -> None:
    plan = SweepPlan(target=router.url, levels=(1, 2), repeats=1, prompt="Tell me.", max_tokens=600, seed=1,
                     model=MODEL, timeout_s=60.0, warmup=1)
    run = await run_sweep(plan)
    assert run.server is not None and (run.server.context_per_request, run.server.slots) == (512, 2)
