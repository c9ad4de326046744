"""Start and stop a real `llama-server` process on loopback (used by the fixtures and the capture script)."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[3]
LCP_VERSION = "0.3.36"  # the llama-cpp-python sdist whose vendored llama.cpp tools/build_llama_server.sh builds
CACHE_ROOT = Path(os.environ.get("LLM_DIAG_CACHE") or Path.home() / ".cache" / "llm-diag-proxy")
BUILD_DIR = CACHE_ROOT / f"llama.cpp-{LCP_VERSION}"
DEFAULT_BINARY = BUILD_DIR / "build" / "bin" / "llama-server"
BINARY = Path(os.environ.get("LLAMA_SERVER_BIN", str(DEFAULT_BINARY)))
START_TIMEOUT_S = 60.0
ALIAS = "tiny"  # the model name the server reports (else it reports the .gguf path)


def binary_available() -> bool:
    return BINARY.is_file() and os.access(BINARY, os.X_OK)


@dataclass
class LlamaServer:
    """One llama-server process on 127.0.0.1, its log kept so a failure can show why."""

    model: Path
    ctx_size: int
    parallel: int
    extra_args: tuple[str, ...] = ()
    log_path: Path | None = None
    port: int = 0
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def unified_kv(self) -> bool:
        return "--kv-unified" in self.extra_args

    @property
    def slot_ctx(self) -> int:
        """Tokens one slot may hold: all of --ctx-size with a unified KV cache, else ctx / parallel."""
        return self.ctx_size if self.unified_kv else self.ctx_size // self.parallel

    def argv(self) -> list[str]:
        return [
            str(BINARY),
            "--model", str(self.model),
            "--alias", ALIAS,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--ctx-size", str(self.ctx_size),
            "--parallel", str(self.parallel),
            "--threads", "2",
            "--metrics",
            "--slots",
            *self.extra_args,
        ]  # fmt: skip

    def start(self, log_path: Path) -> None:
        """Start the process and return once `/health` answers 200 (the model is loaded)."""
        self.log_path = log_path
        self.port = free_port()
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 while the model loads
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"llama-server not healthy after {START_TIMEOUT_S} s:\n{self.log_tail()}")

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

    def version(self) -> str:
        """What `llama-server --version` prints (build number and commit)."""
        done = subprocess.run([str(BINARY), "--version"], capture_output=True, text=True, timeout=30)
        return (done.stdout + done.stderr).strip()
