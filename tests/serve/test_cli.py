"""The command line: one-line errors with exit code 2, and `serve` really serving."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from proxy.serve.cli import main
from tests.support.ports import free_port


@pytest.mark.parametrize("argv", [
    ["--listen", "nohost"],
    ["serve", "--listen", "127.0.0.1:99999"],
    ["--upstream", "ftp://example"],
    ["--upstream", "http://"],
    ["--deadline", "-3"],
    ["--deadline", "soon"],
    ["--deadline-mode", "sometimes"],
    ["--ring-size", "0"],
    ["--no-such-flag"],
    ["--max-in-flight", "0"],
    ["--queue-timeout", "0"],
    ["--server-traces", "maybe"],
    ["--server-traces-wait", "soon"],
])
def test_bad_flag_is_one_line_and_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("llm-diag-proxy: error:")
    assert "Traceback" not in err


def test_the_gate_with_workers_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--max-in-flight", "2", "--workers", "2", "--listen", "127.0.0.1:0",
                 "--admin-listen", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err
    assert err == ("llm-diag-proxy: error: --max-in-flight needs one process: the gate's queue is not shared "
                   "between --workers yet\n")


@pytest.mark.parametrize("name", ["X Client", "client:id", "b\\ad", "naïve"])
def test_a_client_header_no_request_could_carry_is_one_line_and_exit_2(
        name: str, capsys: pytest.CaptureFixture[str]) -> None:
    # (accepted before, it matched no request: every client went unnamed, silently)
    assert main(["--client-header", name, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
                 "--history", "off"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"llm-diag-proxy: error: invalid --client-header {name!r}: not a header name")
    assert err.count("\n") == 1


def test_a_password_file_beside_a_history_file_is_one_line_and_exit_2(
        tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    password = os.path.join(str(tmp_path), "password")
    with open(password, "w") as f:
        f.write("pw\n")
    history = os.path.join(str(tmp_path), "h.sqlite3")
    assert main(["--history", history, "--history-password-file", password, "--listen", "127.0.0.1:0",
                 "--admin-listen", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err
    assert err == (f"llm-diag-proxy: error: --history-password-file is the password of a PostgreSQL history "
                   f"(--history postgresql://...); the history here is the file {history}: nothing would read it\n")


def test_bad_environment_value_is_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LLM_DIAG_UPSTREAM", "not a url")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid upstream URL 'not a url'" in err and err.count("\n") == 1


def test_serve_is_the_default_command_and_answers(tmp_path: object) -> None:
    port, admin = free_port(), free_port()
    env = {**os.environ, "LLM_DIAG_ADMIN_LISTEN": f"127.0.0.1:{admin}"}
    process = subprocess.Popen(
        [sys.executable, "-m", "proxy", "--upstream", "http://127.0.0.1:9", "--listen", f"127.0.0.1:{port}",
         "--gpu-poll-interval", "0", "--upstream-metrics", "off"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        for _ in range(100):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{admin}/healthz", timeout=1) as response:
                    assert response.status == 200
                    break
            except OSError:
                time.sleep(0.1)
        else:
            raise AssertionError("serve did not start")
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=b"{}",
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(request, timeout=5)
        assert error.value.code == 502
    finally:
        process.terminate()
        out, err = process.communicate(timeout=10)
    assert process.returncode == 0, err
    assert b'"event":"response"' in out and b'"stop_reason":"upstream_error"' in out
    assert b"Traceback" not in err


def test_port_in_use_is_one_line_and_exit_2() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        busy = sock.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "proxy", "serve", "--listen", f"127.0.0.1:{busy}", "--admin-listen",
             "127.0.0.1:0", "--gpu-poll-interval", "0", "--upstream-metrics", "off"],
            capture_output=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr.decode().startswith("llm-diag-proxy: error: cannot listen")
    assert b"Traceback" not in result.stderr
