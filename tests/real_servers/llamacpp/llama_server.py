"""Start and stop a real `llama-server` process on loopback (used by the fixtures and the capture script)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.ports import free_port
from tests.support.server_process import ServerProcess

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
class LlamaServer(ServerProcess):
    """One llama-server process on 127.0.0.1, its log kept so a failure can show why."""

    name = "llama-server"
    start_timeout_s = START_TIMEOUT_S

    model: Path
    ctx_size: int
    parallel: int
    extra_args: tuple[str, ...] = ()
    log_path: Path | None = None
    port: int = 0
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

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
        self.port = free_port()
        self.launch(self.argv(), log_path)

    def version(self) -> str:
        """What `llama-server --version` prints (build number and commit)."""
        done = subprocess.run([str(BINARY), "--version"], capture_output=True, text=True, timeout=30)
        return (done.stdout + done.stderr).strip()
