"""A sweep through a running proxy, as `llm-diag-proxy sweep` runs one, for the real-server demos."""

from __future__ import annotations

import io

from proxy.sweep.runner import SweepPlan
from proxy.sweep.session import SweepOutcome, execute


async def sweep_through(proxy_url: str, admin_url: str, *, prompt: str, levels: tuple[int, ...], repeats: int,
                        model: str, max_tokens: int, timeout_s: float, warmup: int) -> tuple[SweepOutcome, str]:
    """One greedy, seeded sweep of an OpenAI chat endpoint; the outcome and what it printed."""
    plan = SweepPlan(target=proxy_url, admin=admin_url, admin_token=None, levels=levels, repeats=repeats,
                     prompt=prompt, max_tokens=max_tokens, seed=42, temperature=0.0, model=model,
                     dialect="openai", timeout_s=timeout_s, warmup=warmup)
    printed = io.StringIO()
    outcome = await execute(plan, out_dir=None, report_path=None, progress=False, stdout=printed)
    return outcome, printed.getvalue()
