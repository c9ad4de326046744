"""tools/gpu_check.py, the prepared end-to-end GPU telemetry check, kept from rotting.

It runs for real here twice (simulator + proxy in subprocesses): once on this machine's own
NVML, which has no driver, and once on a fake `pynvml` module put first on PYTHONPATH, so
the checks of the driver mode run too. Its judgement is also tested on made-up results.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pynvml
import pytest

ROOT = Path(__file__).resolve().parents[3]
TOOL = ROOT / "tools" / "gpu_check.py"
FAKE_NVML = ROOT / "tests" / "fixtures" / "fake_nvml"
GIB = 1 << 30

_spec = importlib.util.spec_from_file_location("gpu_check", TOOL)
assert _spec is not None and _spec.loader is not None
gpu_check: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def driver_present() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def run_tool(out: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any], str]:
    result = subprocess.run([sys.executable, str(TOOL), "--out", str(out), "--requests", "8", "--concurrency",
                             "4", "--max-tokens", "48", *args], capture_output=True, text=True,
                            env=env or dict(os.environ), timeout=110)
    report = json.loads((out / "gpu_check.json").read_text())
    return result.returncode, report, result.stdout + result.stderr


@pytest.mark.timeout(120)
def test_no_driver_run_serves_and_says_so_once(tmp_path: Path) -> None:
    if driver_present():
        pytest.skip("this machine has an NVIDIA driver: the no-driver mode cannot be checked here")
    rc, report, output = run_tool(tmp_path, "--expect-gpu", "no")
    assert rc == 0, output
    assert report["mode"] == "no_driver" and report["ok"]
    assert "NVMLError" in report["nvml"]["error"]
    assert [e["event"] for e in report["telemetry_events"] if e["event"].startswith("gpu_")] == [
        "gpu_telemetry_unavailable"]
    assert len(report["records"]) == 8
    assert all(r["gpu"] is None and r["kv_cache_usage_max"] is not None for r in report["records"])
    assert (tmp_path / "proxy.log").stat().st_size > 0 and (tmp_path / "upstream.log").exists()


@pytest.mark.timeout(120)
def test_driver_mode_on_a_fake_nvml_checks_records_metrics_and_attribution(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_NVML), str(ROOT)]),
           "FAKE_NVML_PROCESS_MATCH": "_upstream"}
    rc, report, output = run_tool(tmp_path, "--expect-gpu", "yes", env=env)
    assert rc == 0, output
    assert report["mode"] == "driver" and report["nvml"]["driver_version"] == "fake"
    names = {c["check"] for c in report["checks"]}
    assert "records are attributed to the GPU running the upstream's pid (rule 1)" in names
    assert "llm_proxy_gpu_process_memory_bytes has the upstream's pid" in names
    assert all(r["gpu"] == "0" and r["vram_free_min_bytes"] > 0 for r in report["records"])
    assert any("torch" in f for f in report["findings"])  # no torch here: nothing holds memory


def _inputs(**changes: Any) -> dict[str, Any]:
    """Results of a good driver-mode run with one GPU and the upstream (pid 4242) on it."""
    gpu = {"index": 0, "uuid": "GPU-1", "name": "H200", "used_bytes": 10 * GIB, "free_bytes": 130 * GIB,
           "total_bytes": 141 * GIB, "utilization_ratio": 0.5,
           "processes": [{"pid": 4242, "name": "python3", "used_bytes": 8 * GIB}]}
    nvml = {"error": None, "device_count": 1, "errors": [], "gpus": [gpu]}
    records = [{"request_id": f"gpu-check-{i}", "status": 200, "gpu": "0", "vram_free_min_bytes": (130 - i) * GIB,
                "vram_used_max_bytes": (10 + i) * GIB, "upstream_running_max": 4.0, "upstream_waiting_max": 0.0,
                "kv_cache_usage_max": 0.9, "preemptions_during": 1.0, "preemptions_scope": "server_wide",
                "observer_errors": []} for i in range(3)]
    labels = {"gpu": "0", "uuid": "GPU-1", "name": "H200"}
    samples = [{"name": f"llm_proxy_gpu_memory_{n}_bytes", "labels": labels, "value": 1.0}
               for n in ("used", "free", "total")]
    samples += [{"name": "llm_proxy_gpu_telemetry_up", "labels": {}, "value": 1.0},
                {"name": "llm_proxy_gpu_utilization_ratio", "labels": labels, "value": 0.5},
                {"name": "llm_proxy_gpu_process_memory_bytes", "labels": {"gpu": "0", "pid": "4242",
                                                                          "process": "python3"}, "value": 8.0 * GIB},
                {"name": "llm_proxy_upstream_telemetry_up", "labels": {"source": "vllm"}, "value": 1.0}]
    inputs = {"nvml": nvml, "answers": [{"request_id": r["request_id"], "status": 200, "done": True}
                                        for r in records],
              "records": records, "samples": samples, "events": [{"event": "gpu_telemetry_available"}],
              "holder": {"active": True, "pid": 4242, "base_mib": 8192, "note": None}, "upstream_pid": 4242,
              "expect_gpu": "yes", "nvml_during": nvml}
    inputs.update(changes)
    return inputs


def failed(**changes: Any) -> list[str]:
    _, verdict = gpu_check.judge(**_inputs(**changes))
    return [c["check"] for c in verdict.checks if not c["ok"]]


def test_judge_passes_a_good_driver_run() -> None:
    mode, verdict = gpu_check.judge(**_inputs())
    assert mode == "driver" and verdict.ok and verdict.findings == []


def test_judge_fails_a_record_without_vram_figures() -> None:
    records = _inputs()["records"]
    records[1] = {**records[1], "vram_free_min_bytes": None}
    assert failed(records=records) == ["every record has gpu, vram_free_min_bytes and vram_used_max_bytes"]


def test_judge_fails_when_the_held_memory_does_not_show() -> None:
    holder = {"active": True, "pid": 4242, "base_mib": 20 * 1024, "note": None}
    assert failed(holder=holder) == ["some record's vram_used_max_bytes covers the memory the upstream holds"]


def test_judge_fails_misattribution_and_a_missing_process_series() -> None:
    records = [{**r, "gpu": "1"} for r in _inputs()["records"]]
    assert "records are attributed to the GPU running the upstream's pid (rule 1)" in failed(records=records)
    samples = [s for s in _inputs()["samples"] if s["name"] != "llm_proxy_gpu_process_memory_bytes"]
    assert failed(samples=samples) == ["llm_proxy_gpu_process_memory_bytes has the upstream's pid"]


def test_judge_reports_another_pid_namespace_as_a_finding_not_a_failure() -> None:
    nvml = _inputs()["nvml"]
    other = {**nvml, "gpus": [{**nvml["gpus"][0], "processes": [{"pid": 99, "name": "", "used_bytes": GIB}]}]}
    _, verdict = gpu_check.judge(**_inputs(nvml_during=other))
    assert verdict.ok
    assert any("not the upstream's pid 4242" in f for f in verdict.findings)


def test_judge_without_a_driver_when_one_was_expected_fails() -> None:
    nvml = {"error": "nvmlInit: NVMLError_LibraryNotFound (NVML Shared Library Not Found)", "device_count": None,
            "errors": [], "gpus": []}
    records = [{**r, "gpu": None, "vram_free_min_bytes": None, "vram_used_max_bytes": None}
               for r in _inputs()["records"]]
    samples = [s for s in _inputs()["samples"] if s["name"].startswith("llm_proxy_upstream_")]
    samples.append({"name": "llm_proxy_gpu_telemetry_up", "labels": {}, "value": 0.0})
    events = [{"event": "gpu_telemetry_unavailable"}]
    common = {"nvml": nvml, "nvml_during": nvml, "records": records, "samples": samples, "events": events}
    assert failed(**common) == ["an NVIDIA driver is usable (--expect-gpu yes)"]
    assert failed(**common, expect_gpu="auto") == []
    assert failed(**{**common, "events": events * 2}, expect_gpu="auto") == [
        "exactly one gpu_telemetry_unavailable log line"]


def test_holder_state_reads_what_the_upstream_child_said() -> None:
    held = gpu_check.holder_state("gpu_check holder: pid 12 holds 1024 MiB on cuda:0\n"
                                  "gpu_check holder: reached 4096 MiB\n")
    assert held == {"active": True, "pid": 12, "base_mib": 1024, "reached_mib": 4096, "note": None}
    oom = gpu_check.holder_state("gpu_check holder: failed: OutOfMemoryError: CUDA out of memory\n")
    assert (oom["active"], oom["note"]) == (False, "failed: OutOfMemoryError: CUDA out of memory")
    assert gpu_check.holder_state("gpu_check holder: torch not importable; holding no GPU memory\n")["note"] == (
        "torch not importable")
    assert "said nothing" in gpu_check.holder_state("")["note"]
