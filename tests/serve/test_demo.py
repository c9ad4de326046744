"""`llm-diag-proxy demo` end to end: simulator, proxy and sweep in one process; the verdict names
the mechanism the simulator was set to, which the sweep never sees."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

SHORT = ("--levels", "1,8", "--repeats", "2", "--no-progress")


def demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy", "demo", *args], capture_output=True, text=True,
                          timeout=90, check=False)


EXPECTED = {
    "clamp": ("VERDICT (serving_defect)", "answers are cut by length:server_limit from concurrency 8"),
    "reject": ("VERDICT (policy)", "admission control (requests rejected) ends answers from concurrency 8"),
    "deadline": ("VERDICT (hidden_cap, inferred)", "a server-side wall-clock cap of about"),
    "healthy": ("VERDICT (no_load_effect)", "no load effect on completion shown"),
    "preempt": ("VERDICT (no_load_effect)", "no load effect on completion shown"),
}


@pytest.fixture(scope="module")
def demo_runs() -> dict[str, tuple[int, str, str]]:
    """One short demo per scenario, run side by side (each mostly waits on its simulated clock)."""
    processes = {scenario: subprocess.Popen(
        [sys.executable, "-m", "proxy", "demo", "--scenario", scenario, *SHORT],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for scenario in EXPECTED}
    results = {}
    for scenario, process in processes.items():
        stdout, stderr = process.communicate(timeout=120)
        results[scenario] = (process.returncode, stdout, stderr)
    return results


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_demo_verdict_names_the_mechanism_the_simulator_was_set_to(
        scenario: str, demo_runs: dict[str, tuple[int, str, str]]) -> None:
    returncode, stdout, stderr = demo_runs[scenario]
    verdict, named = EXPECTED[scenario]
    assert returncode == 0, stderr
    line = next(line for line in stdout.splitlines() if line.startswith("VERDICT"))
    assert line.startswith(verdict) and named in line, stdout
    assert "(records joined from the proxy: 18 of 18)" in stdout
    assert "Traceback" not in stderr
    # Without --keep-running its listeners are gone when it ends: it names no address to visit.
    assert not re.search(r"http://127\.0\.0\.1:\d+/metrics", stdout) and "run it with --keep-running" in stdout


def test_demo_with_defaults_prints_table_verdict_and_keeps_metrics_up_until_interrupted() -> None:
    """The README's first command (plus --keep-running to look at /metrics afterwards)."""
    process = subprocess.Popen([sys.executable, "-m", "proxy", "demo", "--no-progress", "--keep-running"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        lines: list[str] = []
        for line in process.stdout:
            lines.append(line)
            if line.lstrip().startswith("proxy:"):  # the last address it names
                break
        out = "".join(lines)
        assert "scenario 'clamp', hidden from the sweep" in out
        assert re.search(r"^ +8 +24 ", out, re.MULTILINE)  # concurrency 8: 8 slots x 3 requests
        assert "VERDICT (serving_defect): answers are cut by length:server_limit" in out
        assert "--keep-running: the simulator and the proxy stay up until Ctrl-C" in out
        found = re.search(r"^  metrics: (http://127\.0\.0\.1:\d+/metrics)$", out, re.MULTILINE)
        assert found is not None, out
        with urllib.request.urlopen(found.group(1), timeout=10) as response:
            text = response.read().decode()
        assert re.search(r'^llm_proxy_requests_total\{.*stop_reason="length".*\} [1-9]', text, re.MULTILINE)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


def test_demo_bad_flag_is_one_line_and_exit_2() -> None:
    result = demo("--scenario", "nonsense")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "invalid choice: 'nonsense'" in result.stderr


def test_demo_on_a_busy_port_is_one_line_and_exit_2() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = demo("--listen", f"127.0.0.1:{port}", "--no-progress")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("llm-diag-proxy: error: cannot start the proxy: ")
    assert "address already in use" in result.stderr
