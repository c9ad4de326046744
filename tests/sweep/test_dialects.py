"""The sweep speaks every dialect the simulator serves, and reaches the same verdict in each."""

from __future__ import annotations

import io

import pytest

from proxy.serve.app import start_proxy
from proxy.simulator import start_simulator
from proxy.simulator.settings import SCENARIOS
from proxy.sweep.runner import SweepPlan
from proxy.sweep.session import execute
from tests.support.proxies import proxy_config


@pytest.mark.parametrize("dialect", ["openai", "ollama", "anthropic", "responses"])
async def test_the_clamp_is_found_in_every_dialect(dialect: str) -> None:
    config = SCENARIOS["clamp"]
    async with await start_simulator(config) as simulator:
        proxy = await start_proxy(proxy_config(simulator.url))
        try:
            plan = SweepPlan(target=proxy.proxy_url, admin=proxy.admin_url, levels=(1, 8), repeats=2, prompt="hi",
                             max_tokens=128, seed=42, model=config.model, dialect=dialect,  # type: ignore[arg-type]
                             timeout_s=30.0)
            printed = io.StringIO()
            outcome = await execute(plan, out_dir=None, report_path=None, progress=False, stdout=printed)
        finally:
            await proxy.close()
    assert all(s.record_source == "proxy" and s.record.dialect == dialect for s in outcome.samples)
    verdict = outcome.verdict
    assert (verdict.kind, verdict.cause, verdict.onset_level) == ("serving_defect", "length:server_limit", 8), \
        printed.getvalue()
