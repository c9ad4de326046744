"""`llm-diag-proxy simulate`: flags over scenarios, one-line errors, and the real process."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from dataclasses import replace

import aiohttp
import pytest

from proxy.serve.cli import build_parser, main
from proxy.simulator.settings import SCENARIOS
from proxy.simulator.simulate_command import config_from_args


def parse(*argv: str) -> object:
    return config_from_args(build_parser().parse_args(["simulate", *argv]))


def test_without_flags_the_clamp_scenario_runs() -> None:
    assert parse() == SCENARIOS["clamp"]


def test_flags_override_the_chosen_scenario() -> None:
    config = parse("--scenario", "deadline", "--deadline", "1.5", "--model", "m", "--slots", "2")
    assert config == replace(SCENARIOS["deadline"], deadline_s=1.5, model="m", slots=2)


@pytest.mark.parametrize(("argv", "message"), [
    (["--kv-blocks", "-1"], "must be 0 or more"),
    (["--block-size", "0"], "must be at least 1"),
    (["--kv-policy", "drop"], "invalid choice"),
    (["--deadline", "soon"], "invalid number of seconds"),
    (["--listen", "nowhere"], "expected HOST:PORT"),
    (["--reject-status", "500"], "must be 429 or 503"),
    (["--natural-spread", "2"], "natural_spread"),
    (["--slots", "10", "--ctx-size", "5"], "more slots than ctx_size"),
])
def test_bad_values_are_one_line_errors_with_exit_2(argv: list[str], message: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        code = main(["simulate", *argv])
        raise SystemExit(code)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err
    assert err.count("\n") == 1 and err.startswith("llm-diag-proxy: error:") and "Traceback" not in err


async def test_the_simulate_process_serves_until_sigterm() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "simulate", "--listen", "127.0.0.1:0", "--scenario", "healthy",
        "--token-time", "0.001", "--natural-tokens", "2000", stderr=asyncio.subprocess.PIPE)
    try:
        assert process.stderr is not None
        line = (await asyncio.wait_for(process.stderr.readline(), 20)).decode()
        url = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert url and "scenario healthy" in line
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url.group(0)}/health") as resp:
                assert resp.status == 200
            async with session.post(f"{url.group(0)}/api/generate",
                                    json={"model": "sim-7b", "prompt": "hi", "stream": False,
                                          "options": {"num_predict": 5}}) as resp:
                assert (await resp.json())["done"] is True
            # a client that leaves mid-stream must not make the server print a traceback
            resp = await session.post(f"{url.group(0)}/v1/completions", json={"prompt": "x", "stream": True})
            await resp.content.readline()
            resp.close()
            await asyncio.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 20) == 0
        assert (await process.stderr.read()) == b""  # nothing logged per request, no traceback
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_a_busy_port_is_a_one_line_error() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "simulate", "--listen", f"127.0.0.1:{port}",
        stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(process.communicate(), 20)
    server.close()
    await server.wait_closed()
    assert process.returncode == 2
    assert err.decode().count("\n") == 1 and f"cannot listen on 127.0.0.1:{port}" in err.decode()
