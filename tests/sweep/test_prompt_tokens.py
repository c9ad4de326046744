"""`sweep --prompt-tokens N`: a synthetic prompt whose length the server's own count sets, whatever its
tokenizer (a word one token in the usual ones, several in a character-level one) and chat template."""

from __future__ import annotations

import orjson
import pytest
from aiohttp import web

from proxy.sweep.runner import CALIBRATION_ROUNDS, SweepPlan, run_sweep, synthetic_prompt
from tests.support.loopback_app import LoopbackApp
from tests.support.wire import openai_stream


class CountingServer(LoopbackApp):
    """An OpenAI chat server that counts a prompt as `per_char` tokens a character plus a template's
    `template` tokens, and says so in the stream's usage (or says nothing, `usage=False`)."""

    def __init__(self, per_char: float, template: int, usage: bool = True) -> None:
        self.server = None
        self.per_char, self.template, self.usage = per_char, template, usage
        self.prompts: list[int] = []

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        count = self.template + round(self.per_char * len(body["messages"][0]["content"]))
        self.prompts.append(count)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in openai_stream(4, usage=self.usage, prompt=count):
            await response.write(chunk)
        await response.write_eof()
        return response


@pytest.mark.parametrize(("per_char", "template"), [(0.2, 12), (1.0, 40), (0.35, 0)])
async def test_the_synthetic_prompt_is_as_long_as_asked_by_the_servers_count(per_char: float, template: int) -> None:
    server = CountingServer(per_char, template)
    await server.start()
    try:
        plan = SweepPlan(target=server.url, levels=(1, 2), repeats=1, prompt="unused", max_tokens=8, seed=1,
                         model="m", prompt_tokens=300)
        run = await run_sweep(plan)
        measured = [s.record.prompt_tokens for s in run.samples]
        assert all(count is not None and abs(count - 300) <= 6 for count in measured), measured
        assert len(server.prompts) <= 1 + CALIBRATION_ROUNDS + 3  # warm-up, calibration, then the 3 of the sweep
        assert run.plan is not None and run.plan.prompt_words is not None
        assert any("by the server's count (asked: 300)" in note for note in run.notes)
    finally:
        await server.close()


async def test_a_server_that_counts_nothing_keeps_the_first_guess_and_says_so() -> None:
    server = CountingServer(0.2, 12, usage=False)
    await server.start()
    try:
        plan = SweepPlan(target=server.url, levels=(1,), repeats=1, prompt="unused", max_tokens=8, seed=1,
                         model="m", prompt_tokens=100)
        run = await run_sweep(plan)
        assert len(server.prompts) == 2  # the warm-up and the one request: no calibration without a count
        assert any("the server said no prompt count" in note for note in run.notes)
    finally:
        await server.close()


def test_the_synthetic_prompt_is_words_the_usual_tokenizers_take_as_one_token_each() -> None:
    text = synthetic_prompt(50)
    words = text.split(":", 1)[1].split()
    assert len(words) == 50 and all(word.isalpha() and word.islower() for word in words)
