"""Open-loop sweeps: requests at fixed rates (constant or Poisson), goodput against latency
targets, the verdict in the concurrency each request met and in the rate, and the report."""

from __future__ import annotations

import argparse
import io
import itertools
from pathlib import Path

import orjson
import pytest

from proxy.config import ConfigError
from proxy.serve.app import start_proxy
from proxy.simulator import SCENARIOS, start_simulator
from proxy.sweep.open_loop import arrivals, parse_rates, parse_slo
from proxy.sweep.session import execute
from proxy.sweep.sweep_command import plan_from_args
from tests.support.proxies import proxy_config


def test_rates_targets_and_arrivals_are_read_and_drawn_as_said() -> None:
    assert parse_rates("4, 1,2,0.5") == (0.5, 1.0, 2.0, 4.0)
    for bad in ("0", "-1", "x", "", "1e9"):
        with pytest.raises(ConfigError):
            parse_rates(bad)
    slo = parse_slo("ttft=500ms,itl=50ms,e2e=30s")
    assert (slo.ttft_s, slo.itl_s, slo.e2e_s) == (0.5, 0.05, 30.0)
    for bad in ("ttft", "tpot=1s", "ttft=fast", "e2e=0s"):
        with pytest.raises(ConfigError):
            parse_slo(bad)
    assert arrivals(4, 2, "constant", 1) == [n / 4 for n in range(8)]
    poisson = arrivals(10, 60, "poisson", 7)
    assert poisson == arrivals(10, 60, "poisson", 7) != arrivals(10, 60, "poisson", 8)  # seeded: repeatable
    assert 500 < len(poisson) < 700 and all(0 <= t < 60 for t in poisson)  # about 600
    gaps = [b - a for a, b in itertools.pairwise(poisson)]
    assert 0.08 < sum(gaps) / len(gaps) < 0.12  # mean gap 1/rate


async def test_a_poisson_sweep_against_the_simulator_scores_goodput_and_names_the_onset(tmp_path: Path) -> None:
    simulator = await start_simulator(SCENARIOS["clamp"])
    proxy = await start_proxy(proxy_config(simulator.url))
    try:
        args = argparse.Namespace(levels=(1,), repeats=1, prompt="Explain gears.", max_tokens=128, seed=3,
                                  temperature=0.0, timeout=30.0, warmup=1, rates=parse_rates("1,2,16"),
                                  arrivals="poisson", rate_seconds=4.0, slo=parse_slo("ttft=2s,e2e=20s"))
        plan = plan_from_args(args, proxy.proxy_url, proxy.admin_url, SCENARIOS["clamp"].model)
        out = io.StringIO()
        outcome = await execute(plan, out_dir=str(tmp_path), report_path=str(tmp_path / "report.html"),
                                progress=False, stdout=out)
    finally:
        await proxy.close()
        await simulator.close()
    text = out.getvalue()
    assert "open loop, goodput: answers complete within ttft<=2.00s, e2e<=20.00s" in text
    assert "by the concurrency each request met:" in text
    assert all(s.record_source == "proxy" and s.client.rate in (1.0, 2.0, 16.0) for s in outcome.samples)
    data = orjson.loads((tmp_path / "sweep.json").read_bytes())
    rates = {r["rate"]: r for r in data["plan"]["rates_summary"]}
    assert set(rates) == {1.0, 2.0, 16.0} and rates[1.0]["completion_rate"] == 1.0
    assert rates[1.0]["good"] == rates[1.0]["sent"] and rates[1.0]["goodput_per_s"] > 0
    assert rates[16.0]["concurrency_max"] >= 4 and rates[16.0]["completion_rate"] < 1.0  # KV cache clamps
    verdict = outcome.verdict
    assert verdict.kind == "serving_defect" and verdict.onset_level is not None and verdict.onset_level >= 2
    assert "(by arrival rate: from " in verdict.headline and verdict.evidence[0].startswith(
        "completion by arrival rate: 1/s: 100%")
    assert "Open loop: by arrival rate (poisson)" in (tmp_path / "report.html").read_text()
