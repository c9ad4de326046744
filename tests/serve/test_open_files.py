"""A serving process's limit of open files: raised to the hard limit at start (a stream holds two
descriptors; a soft limit of 1024 would refuse streams from about 450 at once on), and said where
the hard limit itself bounds the streams."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.ports import free_port
from tests.support.proxies import ROOT

RAISE = ("import resource; from proxy.serve.wiring import open_files; "
         "print(open_files(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])")


def test_the_soft_limit_of_open_files_is_raised_to_the_hard_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    expected = hard if hard != resource.RLIM_INFINITY else 1 << 20
    result = subprocess.run([sys.executable, "-c", RAISE], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(expected), str(expected)]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_hard_limit_that_bounds_the_streams_is_said_at_start(workers: int, tmp_path: Path) -> None:
    log = tmp_path / "proxy.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--workers", str(workers), "--upstream", "http://127.0.0.1:9",
         "--listen", f"127.0.0.1:{free_port()}", "--admin-listen", f"127.0.0.1:{free_port()}",
         "--gpu-poll-interval", "0", "--upstream-metrics", "off", "--history", "off", "--log-format", "json"],
        cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300)))
    try:
        deadline = time.monotonic() + 60
        while True:
            lines = [json.loads(line) for line in log.read_bytes().splitlines() if line.startswith(b"{")]
            events = {line.get("event") for line in lines}
            if {"few_open_files", "listening"} <= events:
                break
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    finally:
        process.terminate()
        process.wait(timeout=40)
    (listening,) = [line for line in lines if line.get("event") == "listening"]
    (warning,) = [line for line in lines if line.get("event") == "few_open_files"]
    assert listening["open_files"] == 300 and warning["limit"] == 300 and warning["level"] == "warning"
    assert "about 150 streams" in str(warning["note"])
