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
from dataclasses import dataclass, field
from pathlib import Path

from tests.real_servers.llamacpp.llama_server import ALIAS, BUILD_DIR, CACHE_ROOT, LCP_VERSION, free_port
from tests.support.server_process import ServerProcess

PYTHON = Path(os.environ.get("LLAMA_CPP_PYTHON", str(CACHE_ROOT / f"llama-cpp-python-{LCP_VERSION}" / "bin" /
                                                     "python")))
LIB_DIR = BUILD_DIR / "build" / "bin"
START_TIMEOUT_S = 60.0


def available() -> bool:
    return PYTHON.is_file() and (PYTHON.parent.parent / ".installed").is_file() and (LIB_DIR / "libllama.so").is_file()


@dataclass
class LlamaCppPythonServer(ServerProcess):
    model: Path
    n_ctx: int = 1024
    log_path: Path | None = None
    port: int = 0
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    name = "llama_cpp.server"
    ready_path = "/v1/models"
    start_timeout_s = START_TIMEOUT_S

    def start(self, log_path: Path) -> None:
        self.port = free_port()
        argv = [str(PYTHON), "-m", "llama_cpp.server", "--model", str(self.model), "--model_alias", ALIAS,
                "--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", str(self.n_ctx), "--n_threads", "2"]
        self.launch(argv, log_path, env={**os.environ, "LLAMA_CPP_LIB_PATH": str(LIB_DIR)})
