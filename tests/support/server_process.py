"""A real inference server in a process of its own on 127.0.0.1: started and waited for until a
GET answers 200, stopped politely and then killed, its log kept so that a failure shows why."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


class ServerProcess:
    """What llama-server, llama-cpp-python's server and vLLM have in common here (a dataclass
    subclass holds `log_path`, `port` and `process`)."""

    name = "the server"
    ready_path = "/health"  # answers 200 once the model is loaded
    start_timeout_s = 60.0
    poll_s = 0.1
    own_group = False  # the server starts processes of its own: stop them with it
    log_lines = 40
    log_path: Path | None
    port: int
    process: subprocess.Popen[bytes] | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        """Run `argv` (its port already in it) and return once `ready_path` answers 200."""
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=self.own_group)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}{self.ready_path}", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 while the model loads
            time.sleep(self.poll_s)
        self.stop()
        raise RuntimeError(f"{self.name} not up after {self.start_timeout_s} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL; to the whole process group when the server has one of its own."""
        process = self.process
        if process is None or (process.poll() is not None and not self.own_group):
            return
        for sig, wait_s in ((signal.SIGTERM, 30 if self.own_group else 10), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                if self.own_group:
                    os.killpg(process.pid, sig)
                else:
                    process.send_signal(sig)
            try:
                process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        if self.own_group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # a child process left behind

    def log_tail(self, lines: int | None = None) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-(lines or self.log_lines):])
