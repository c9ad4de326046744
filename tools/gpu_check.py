"""The end-to-end check of GPU telemetry (issue 4's "Done when"), prepared to run in one go.

On a machine with an NVIDIA GPU it checks that every record and the metrics carry VRAM and
server-state figures for the response's life; without a driver, that the proxy serves as
before and says so once. Steps, all on loopback, nothing downloaded:

1. read NVML directly through the proxy's own reader (init, one read, shutdown);
2. start the simulator as the upstream in a child process of this script; where torch with
   CUDA is importable, that process also takes GPU memory and grows it while traffic runs,
   so the listening pid is a GPU process (attribution rule 1) and the VRAM figures move;
3. start the proxy (`python -m proxy serve`) in front of it, polling NVML and the
   simulator's vLLM `/metrics` every 0.2 s;
4. stream chat completions through the proxy at some concurrency;
5. read the records from the admin API and `/metrics`, and judge them.

It writes `gpu_check.json` (checks, findings, the NVML read, metric lines, records) and the
two children's logs under `--out` (default `$OUT`, else `./gpu_check_out`); exit code 0 when
every check holds, 1 otherwise. Findings are facts worth knowing that are not failures (NVML
shows no process with the server's pid, as in a container's pid namespace).

    python3 tools/gpu_check.py                  # judges by whether NVML initializes
    python3 tools/gpu_check.py --expect-gpu yes # on a GPU machine: no driver is a failure
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python3 tools/gpu_check.py` from anywhere
    sys.path.insert(0, str(ROOT))

POLL_S = 0.2
START_TIMEOUT_S = 90.0  # importing torch and creating a CUDA context can take a while
REQUEST_TIMEOUT_S = 60.0
ID_PREFIX = "gpu-check-"
MIB = 1024 * 1024
TELEMETRY_EVENTS = ("gpu_telemetry_available", "gpu_telemetry_unavailable", "gpu_telemetry_error",
                    "gpu_telemetry_recovered", "upstream_telemetry_available",
                    "upstream_telemetry_unavailable", "upstream_telemetry_error")
METRIC_PREFIXES = ("llm_proxy_gpu_", "llm_proxy_upstream_")
RECORD_FIELDS = ("request_id", "status", "stop_reason", "duration_s", "concurrency_peak", "gpu",
                 "vram_free_min_bytes", "vram_used_max_bytes", "upstream_running_max",
                 "upstream_waiting_max", "kv_cache_usage_max", "preemptions_during", "preemptions_scope",
                 "observer_errors")


# -- step 1: NVML, read directly ---------------------------------------------------------------

def probe_nvml() -> dict[str, Any]:
    """One NVML read through the proxy's reader, as plain data; `error` set when init fails."""
    import pynvml  # type: ignore[import-untyped]

    from proxy.observers.telemetry.gpu import NvmlReader, error_kind

    result: dict[str, Any] = {"pynvml_file": getattr(pynvml, "__file__", None), "error": None,
                              "driver_version": None, "nvml_version": None, "device_count": None,
                              "errors": [], "gpus": []}
    reader = NvmlReader()
    try:
        reader.init()
    except pynvml.NVMLError as exc:
        result["error"] = f"{error_kind('nvmlInit', exc)} ({exc})"
        return result
    try:
        for key, call in (("driver_version", "nvmlSystemGetDriverVersion"),
                          ("nvml_version", "nvmlSystemGetNVMLVersion")):
            with contextlib.suppress(pynvml.NVMLError, AttributeError):
                value = getattr(pynvml, call)()
                result[key] = value.decode() if isinstance(value, bytes) else str(value)
        snapshot = reader.read()
        result["device_count"] = snapshot.device_count
        result["errors"] = list(snapshot.errors)
        result["gpus"] = [asdict(g) for g in snapshot.gpus]
    except pynvml.NVMLError as exc:
        result["error"] = f"{error_kind('nvmlDeviceGetCount', exc)} ({exc})"
    finally:
        reader.shutdown()
    return result


# -- step 2: the upstream child: the simulator, and GPU memory held where torch can -------------

def hold_gpu_memory(base_mib: int, step_mib: int, max_mib: int, every_s: float) -> None:
    """Take `base_mib` of GPU memory, then `step_mib` more every `every_s` up to `max_mib`.

    Runs on a daemon thread of the upstream child; reports on stderr what it could do.
    """
    try:
        import torch  # type: ignore[import-not-found]
    except ImportError:
        print("gpu_check holder: torch not importable; holding no GPU memory", file=sys.stderr, flush=True)
        return
    if not torch.cuda.is_available():
        print("gpu_check holder: torch sees no CUDA device; holding no GPU memory", file=sys.stderr, flush=True)
        return
    try:
        held = [torch.empty(base_mib * MIB, dtype=torch.uint8, device="cuda").fill_(1)]
    except Exception as exc:  # CUDA errors come in many classes; any means: nothing held
        print(f"gpu_check holder: failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return
    total = base_mib
    print(f"gpu_check holder: pid {os.getpid()} holds {total} MiB on cuda:{torch.cuda.current_device()}",
          file=sys.stderr, flush=True)
    with contextlib.suppress(Exception):  # stop growing where memory runs out; what is held stays
        while total + step_mib <= max_mib:
            time.sleep(every_s)
            held.append(torch.empty(step_mib * MIB, dtype=torch.uint8, device="cuda").fill_(1))
            total += step_mib
    print(f"gpu_check holder: reached {total} MiB", file=sys.stderr, flush=True)
    threading.Event().wait()  # keep `held` alive until the process ends


def run_upstream(args: argparse.Namespace) -> int:
    from proxy.serve.cli import main

    if args.hold_mib > 0:
        threading.Thread(target=hold_gpu_memory, daemon=True, name="gpu-holder",
                         args=(args.hold_mib, args.grow_mib, args.max_mib, args.grow_every)).start()
    return main(["simulate", "--listen", args.listen, "--scenario", "preempt", "--token-time", "0.015"])


# -- steps 3-5: proxy, traffic, judgement --------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_http(url: str, deadline: float, child: subprocess.Popen[bytes]) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        while True:
            if child.poll() is not None:
                raise RuntimeError(f"{url}: the process serving it exited with {child.returncode}")
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer 200 within {START_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.2)


def wait_holder(log: Path, deadline: float, child: subprocess.Popen[bytes]) -> None:
    """Wait until the upstream's memory holder says what it holds (or why it holds nothing)."""
    while "gpu_check holder:" not in log.read_text(errors="replace"):
        if child.poll() is not None or time.monotonic() > deadline:
            return  # judged from the log afterwards: the holder is reported inactive
        time.sleep(0.2)


async def one_chat(session: Any, url: str, index: int, max_tokens: int) -> dict[str, Any]:
    import aiohttp

    body = {"model": "sim-7b", "stream": True, "max_tokens": max_tokens, "seed": index,
            "messages": [{"role": "user", "content": f"gpu check request {index}"}]}
    request_id = f"{ID_PREFIX}{index}"
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers={"X-Request-Id": request_id},
                                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as r:
            data = await r.read()
            return {"request_id": request_id, "status": r.status, "done": b"data: [DONE]" in data,
                    "bytes": len(data)}
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        return {"request_id": request_id, "status": None, "done": False, "error": repr(exc)}


async def drive(proxy_url: str, admin_url: str, requests: int, concurrency: int,
                max_tokens: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    import aiohttp

    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:
        async def limited(i: int) -> dict[str, Any]:
            async with gate:
                return await one_chat(session, proxy_url, i, max_tokens)

        answers = list(await asyncio.gather(*(limited(i) for i in range(requests))))
        await asyncio.sleep(0.3)  # records are handed to observers as responses end
        async with session.get(f"{admin_url}/api/requests", params={"limit": "1000"}) as r:
            listing = await r.json()
        async with session.get(f"{admin_url}/metrics") as r:
            metrics_text = await r.text()
    records = [rec for rec in listing["records"] if str(rec.get("request_id", "")).startswith(ID_PREFIX)]
    return answers, records, metrics_text


def parse_metrics(text: str) -> list[dict[str, Any]]:
    """The proxy's GPU and upstream samples from a /metrics page, as {name, labels, value}."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(METRIC_PREFIXES):
                samples.append({"name": s.name, "labels": dict(s.labels), "value": s.value})
    return samples


def log_events(path: Path) -> list[dict[str, Any]]:
    """The telemetry events from the proxy's JSON log (records and access lines left out)."""
    events = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict) and entry.get("event") in TELEMETRY_EVENTS:
                events.append(entry)
    return events


def holder_state(upstream_log: str) -> dict[str, Any]:
    """What the upstream child's memory holder reported: pid and MiB held, or why not."""
    held = re.search(r"gpu_check holder: pid (\d+) holds (\d+) MiB", upstream_log)
    reached = re.search(r"gpu_check holder: reached (\d+) MiB", upstream_log)
    refused = re.search(r"gpu_check holder: (torch .*?); holding|gpu_check holder: (failed: .*)", upstream_log)
    note = next((g for g in refused.groups() if g), None) if refused else None
    if held is None and note is None:
        note = "the holder said nothing: see upstream.log"
    return {"active": held is not None, "pid": int(held.group(1)) if held else None,
            "base_mib": int(held.group(2)) if held else None,
            "reached_mib": int(reached.group(1)) if reached else None, "note": note}


class Verdict:
    def __init__(self) -> None:
        self.checks: list[dict[str, Any]] = []
        self.findings: list[str] = []

    def check(self, name: str, ok: bool, detail: Any = None) -> None:
        self.checks.append({"check": name, "ok": bool(ok), "detail": detail})

    @property
    def ok(self) -> bool:
        return all(c["ok"] for c in self.checks)


def judge(nvml: dict[str, Any], answers: list[dict[str, Any]], records: list[dict[str, Any]],
          samples: list[dict[str, Any]], events: list[dict[str, Any]], holder: dict[str, Any],
          upstream_pid: int | None, expect_gpu: str,
          nvml_during: dict[str, Any] | None = None) -> tuple[str, Verdict]:
    """The checks for the mode NVML put us in: `driver` (GPUs read) or `no_driver`.

    `nvml` is the read before anything started, `nvml_during` the one taken after the traffic
    while the upstream still ran (the one that can list its pid).
    """
    v = Verdict()
    driver = nvml["error"] is None and bool(nvml["gpus"])
    mode = "driver" if driver else "no_driver"
    if expect_gpu == "yes":
        v.check("an NVIDIA driver is usable (--expect-gpu yes)", driver, nvml["error"] or nvml["device_count"])
    elif expect_gpu == "no":
        v.check("no NVIDIA driver is usable (--expect-gpu no)", not driver, nvml["error"])

    def values(name: str) -> list[dict[str, Any]]:
        return [s for s in samples if s["name"] == name]

    def event_count(name: str) -> int:
        return sum(1 for e in events if e.get("event") == name)

    ids = {a["request_id"] for a in answers}
    v.check("every request answered 200 with data: [DONE]",
            all(a["status"] == 200 and a["done"] for a in answers),
            [a for a in answers if not (a["status"] == 200 and a["done"])][:5])
    v.check("a record for every request", {r["request_id"] for r in records} == ids,
            sorted(ids - {r["request_id"] for r in records})[:5])
    v.check("no observer errors in the records", not any(r["observer_errors"] for r in records),
            [r["observer_errors"] for r in records if r["observer_errors"]][:3])

    # The server's own state comes from the simulator's vLLM /metrics in both modes.
    up = values("llm_proxy_upstream_telemetry_up")
    v.check("llm_proxy_upstream_telemetry_up{source=vllm} is 1",
            any(s["labels"].get("source") == "vllm" and s["value"] == 1 for s in up), up)
    for name in ("upstream_running_max", "kv_cache_usage_max", "preemptions_during"):
        missing = [r["request_id"] for r in records if r[name] is None]
        v.check(f"every record has {name}", not missing, missing[:5])
    v.check("preemptions_scope is server_wide wherever preemptions_during is set",
            all(r["preemptions_scope"] == "server_wide" for r in records if r["preemptions_during"] is not None))
    if not any((r["preemptions_during"] or 0) > 0 for r in records):
        v.findings.append("no record saw a preemption (the preempt scenario usually makes some at "
                          "concurrency 8)")

    telemetry_up = [s["value"] for s in values("llm_proxy_gpu_telemetry_up")]
    gpu_series = values("llm_proxy_gpu_memory_used_bytes")
    if not driver:
        v.check("exactly one gpu_telemetry_unavailable log line", event_count("gpu_telemetry_unavailable") == 1,
                [e for e in events if e.get("event", "").startswith("gpu_")])
        v.check("no gpu_telemetry_available log line", event_count("gpu_telemetry_available") == 0)
        v.check("llm_proxy_gpu_telemetry_up is 0", telemetry_up == [0.0], telemetry_up)
        v.check("no GPU memory series", not gpu_series, gpu_series[:3])
        v.check("no record carries gpu or vram fields",
                all(r["gpu"] is None and r["vram_free_min_bytes"] is None and r["vram_used_max_bytes"] is None
                    for r in records))
        return mode, v

    gpus = {str(g["index"]): g for g in nvml["gpus"]}
    v.check("NVML: free + used <= total on every GPU",
            all(g["free_bytes"] + g["used_bytes"] <= g["total_bytes"] for g in nvml["gpus"]),
            [(g["index"], g["used_bytes"], g["free_bytes"], g["total_bytes"]) for g in nvml["gpus"]])
    if nvml["errors"]:
        v.findings.append(f"NVML calls that failed on a direct read: {nvml['errors']}")
    v.check("exactly one gpu_telemetry_available log line", event_count("gpu_telemetry_available") == 1,
            [e for e in events if e.get("event", "").startswith("gpu_")])
    v.check("no gpu_telemetry_unavailable log line", event_count("gpu_telemetry_unavailable") == 0)
    errors = [e for e in events if e.get("event") == "gpu_telemetry_error"]
    if errors:
        v.findings.append(f"gpu_telemetry_error lines: {[e.get('error') for e in errors]}")
    v.check("llm_proxy_gpu_telemetry_up is 1", telemetry_up == [1.0], telemetry_up)
    for name in ("used", "free", "total"):
        series = values(f"llm_proxy_gpu_memory_{name}_bytes")
        v.check(f"llm_proxy_gpu_memory_{name}_bytes has a series per GPU, labelled as NVML names it",
                {(s["labels"]["gpu"], s["labels"]["uuid"], s["labels"]["name"]) for s in series}
                == {(i, g["uuid"], g["name"]) for i, g in gpus.items()}, series)
    if not values("llm_proxy_gpu_utilization_ratio"):
        v.findings.append("no llm_proxy_gpu_utilization_ratio series (NVML reports none, as on MIG)")

    no_vram = [r["request_id"] for r in records
               if r["gpu"] not in gpus or r["vram_free_min_bytes"] is None or r["vram_used_max_bytes"] is None]
    v.check("every record has gpu, vram_free_min_bytes and vram_used_max_bytes", not no_vram, no_vram[:5])
    bounded = [r["request_id"] for r in records if r["gpu"] in gpus
               and r["vram_free_min_bytes"] is not None and r["vram_used_max_bytes"] is not None
               and not (0 <= r["vram_free_min_bytes"] <= gpus[r["gpu"]]["total_bytes"]
                        and 0 < r["vram_used_max_bytes"] <= gpus[r["gpu"]]["total_bytes"])]
    v.check("vram figures lie within the GPU's total", not bounded, bounded[:5])

    during = nvml_during["gpus"] if nvml_during else []
    hosting = [g for g in during if upstream_pid in {p["pid"] for p in g["processes"]}]
    process_series = values("llm_proxy_gpu_process_memory_bytes")
    if hosting:
        index = str(hosting[0]["index"])
        v.check("records are attributed to the GPU running the upstream's pid (rule 1)",
                all(r["gpu"] == index for r in records), sorted({str(r["gpu"]) for r in records}))
        v.check("llm_proxy_gpu_process_memory_bytes has the upstream's pid",
                any(s["labels"]["pid"] == str(upstream_pid) and s["labels"]["gpu"] == index
                    for s in process_series), process_series)
    elif not any(g["processes"] for g in during):
        v.findings.append("NVML lists no compute processes at all (unprivileged container?): "
                          "process series and attribution rule 1 cannot be checked")
    else:
        v.findings.append(f"NVML lists processes but not the upstream's pid {upstream_pid} (another pid "
                          f"namespace?): attribution falls back to rules 2-3; NVML's pids: "
                          f"{[p['pid'] for g in during for p in g['processes']]}")
    if holder["active"]:
        used_max = max((r["vram_used_max_bytes"] or 0 for r in records), default=0)
        v.check("some record's vram_used_max_bytes covers the memory the upstream holds",
                used_max >= holder["base_mib"] * MIB, {"used_max": used_max, "held_mib": holder["base_mib"]})
    else:
        v.findings.append(f"the upstream held no GPU memory ({holder['note']}): VRAM figures that "
                          "move with the server's memory are not exercised")
    if len({r["vram_used_max_bytes"] for r in records}) < 2:
        v.findings.append("every record has the same vram_used_max_bytes: memory did not move during the run")
    return mode, v


def stop(child: subprocess.Popen[bytes]) -> None:
    if child.poll() is None:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def run_check(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    nvml = probe_nvml()
    upstream_port, proxy_port, admin_port = free_port(), free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    children: list[subprocess.Popen[bytes]] = []
    report: dict[str, Any] = {"nvml": nvml, "ok": False}
    t0 = time.monotonic()
    try:
        with open(out / "upstream.log", "wb") as upstream_log, open(out / "proxy.log", "wb") as proxy_log:
            hold = [] if args.hold_mib == 0 else ["--hold-mib", str(args.hold_mib)]
            upstream = subprocess.Popen([sys.executable, __file__, "_upstream", "--listen",
                                         f"127.0.0.1:{upstream_port}", *hold],
                                        stdout=upstream_log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            children.append(upstream)
            asyncio.run(wait_http(f"http://127.0.0.1:{upstream_port}/v1/models",
                                  time.monotonic() + START_TIMEOUT_S, upstream))
            if args.hold_mib:  # torch's import and CUDA init may take longer than the simulator's start
                wait_holder(out / "upstream.log", time.monotonic() + START_TIMEOUT_S, upstream)
            proxy = subprocess.Popen([sys.executable, "-m", "proxy", "serve",
                                      "--upstream", f"http://127.0.0.1:{upstream_port}",
                                      "--listen", f"127.0.0.1:{proxy_port}",
                                      "--admin-listen", f"127.0.0.1:{admin_port}",
                                      "--gpu-poll-interval", str(POLL_S), "--upstream-metrics", "auto",
                                      "--upstream-metrics-interval", str(POLL_S), "--log-format", "json"],
                                     stdout=proxy_log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            children.append(proxy)
            asyncio.run(wait_http(f"http://127.0.0.1:{admin_port}/readyz", time.monotonic() + START_TIMEOUT_S,
                                  proxy))
            time.sleep(1.0)  # let both pollers take a few samples before the first request
            answers, records, metrics_text = asyncio.run(drive(
                f"http://127.0.0.1:{proxy_port}", f"http://127.0.0.1:{admin_port}",
                args.requests, args.concurrency, args.max_tokens))
            report["nvml_during"] = probe_nvml()  # while the upstream still runs: its pid on the GPU
    except (RuntimeError, OSError, KeyError, ValueError) as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        answers, records, metrics_text = [], [], ""
    finally:
        for child in reversed(children):
            stop(child)
    report["elapsed_s"] = round(time.monotonic() - t0, 1)
    upstream_text = (out / "upstream.log").read_text(errors="replace") if (out / "upstream.log").exists() else ""
    holder = holder_state(upstream_text) if args.hold_mib else {"active": False, "note": "--hold-mib 0"}
    samples = parse_metrics(metrics_text) if metrics_text else []
    events = log_events(out / "proxy.log") if (out / "proxy.log").exists() else []
    upstream_pid = children[0].pid if children else None
    mode, verdict = judge(nvml, answers, records, samples, events, holder, upstream_pid, args.expect_gpu,
                          report.get("nvml_during"))
    if "error" in report:
        verdict.check("the run completed", False, report["error"])
    report.update(mode=mode, ok=verdict.ok, checks=verdict.checks, findings=verdict.findings, holder=holder,
                  upstream_pid=upstream_pid, telemetry_events=events, metric_samples=samples,
                  records=[{k: r.get(k) for k in RECORD_FIELDS} for r in records])
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    for c in verdict.checks:
        print(f"{'ok  ' if c['ok'] else 'FAIL'} {c['check']}" + ("" if c["ok"] else f": {c['detail']}"))
    for f in verdict.findings:
        print(f"note {f}")
    print(f"gpu_check: mode {mode}, {'all checks hold' if verdict.ok else 'FAILED'} "
          f"({len(verdict.checks)} checks, {report['elapsed_s']} s); report in {out / 'gpu_check.json'}")
    return 0 if verdict.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode")
    upstream = sub.add_parser("_upstream", help="(internal) the simulator as upstream, holding GPU memory")
    upstream.add_argument("--listen", required=True)
    upstream.add_argument("--hold-mib", type=int, default=0)
    upstream.add_argument("--grow-mib", type=int, default=256)
    upstream.add_argument("--max-mib", type=int, default=4096)
    upstream.add_argument("--grow-every", type=float, default=0.5)
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out",
                        help="folder for gpu_check.json and the logs (default $OUT, else ./gpu_check_out)")
    parser.add_argument("--expect-gpu", choices=("auto", "yes", "no"), default="auto",
                        help="yes: no usable driver is a failure; no: a usable one is (default auto)")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--hold-mib", type=int, default=1024,
                        help="GPU memory the upstream takes where torch+CUDA exist, then grows by 256 MiB "
                             "every 0.5 s to 4 GiB; 0 = none")
    args = parser.parse_args(argv)
    if args.mode == "_upstream":
        return run_upstream(args)
    return run_check(args)


if __name__ == "__main__":
    sys.exit(main())
