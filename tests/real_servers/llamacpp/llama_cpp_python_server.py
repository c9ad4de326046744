"""Start and stop llama-cpp-python's own OpenAI-compatible server (`python -m llama_cpp.server`).

It runs in its own environment (tools/setup_llama_cpp_python.sh) and loads the shared libllama of
the one llama.cpp build the tests make (tools/build_llama_server.sh), through LLAMA_CPP_LIB_PATH.
Two of its habits matter here: with its default `interrupt_requests`, a running stream is ended
with `[DONE]` and no finish reason as soon as another request queues; and it answers an
X-Request-Id that is not a UUID with an empty 400.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.real_servers.llamacpp.llama_server import ALIAS, BUILD_DIR, CACHE_ROOT, LCP_VERSION, free_port

PYTHON = Path(os.environ.get("LLAMA_CPP_PYTHON", str(CACHE_ROOT / f"llama-cpp-python-{LCP_VERSION}" / "bin" /
                                                     "python")))
LIB_DIR = BUILD_DIR / "build" / "bin"
START_TIMEOUT_S = 60.0


def available() -> bool:
    return PYTHON.is_file() and (PYTHON.parent.parent / ".installed").is_file() and (LIB_DIR / "libllama.so").is_file()


@dataclass
class LlamaCppPythonServer:
    model: Path
    n_ctx: int = 1024
    log_path: Path | None = None
    port: int = 0
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log_path: Path) -> None:
        self.log_path = log_path
        self.port = free_port()
        argv = [str(PYTHON), "-m", "llama_cpp.server", "--model", str(self.model), "--model_alias", ALIAS,
                "--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", str(self.n_ctx), "--n_threads", "2"]
        env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(LIB_DIR)}
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"llama_cpp.server not up after {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
