"""The deployment files: valid, consistent with each other, and naming only what the proxy exports.

Needs no Docker engine and no Prometheus: `docker compose config` runs where a compose binary exists;
the real-Prometheus checks are in test_deploy_promtool.py and test_deploy_prometheus.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import pytest
import yaml
from prometheus_client import CollectorRegistry

from proxy.observers.metrics import Created, ProxyMetrics
from tests.support.proxies import ProxyFactory
from tests.support.scripted_upstream import ScriptedUpstream

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
RULES_DIR = ROOT / "deploy/prometheus/rules"
K8S = ROOT / "deploy/k8s"
DASHBOARD = ROOT / "grafana/dashboards/llm-diag-proxy.json"
PROMTOOL_TESTS = ROOT / "tests/deploy/promtool"
# Names in PromQL that are ours: the proxy's metrics, recording rules (level:metric:operation), `up`.
NAME_IN_PROMQL = re.compile(r"(?<![\w:])(llm_proxy_\w+|[a-z_]+:[a-z0-9_]+:[a-z0-9_]+|up)(?![\w:])")


def load_script(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = load_script(ROOT / "deploy/render.py")
alert_cases = load_script(ROOT / "tests/deploy/promtool/build_alert_cases.py")
healthcheck = load_script(ROOT / "deploy/healthcheck.py")


def yaml_docs(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def rules() -> list[dict[str, Any]]:
    return [rule for group in render.rule_groups() for rule in group["rules"]]


def alerts() -> list[dict[str, Any]]:
    return [rule for rule in rules() if "alert" in rule]


def exported_names() -> set[str]:
    """The series names the proxy's registry exposes: counters with _total, histograms with their parts."""
    metrics = ProxyMetrics(CollectorRegistry())
    names: set[str] = set()
    # the upstream's state is exported only while known: describe() lists it all
    for family in [*metrics.registry.collect(), *metrics.upstream_state.describe()]:
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names.update(f"{family.name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        elif family.type == "summary":
            names.update(f"{family.name}{suffix}" for suffix in ("_sum", "_count"))
        else:
            names.add(family.name)
    # the proxy's own counters, histograms and summaries say when each series started (`_created`)
    names.update(f"{metric._name}_created" for metric in vars(metrics).values() if isinstance(metric, Created))
    return names


def names_in(expr: str) -> set[str]:
    return set(NAME_IN_PROMQL.findall(expr))


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def default_of(value: str) -> str:
    """`${VAR:-default}` interpolated with VAR unset, as compose does."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


# --- every file parses --------------------------------------------------------------------------

DEPLOY_YAML = sorted([COMPOSE, *ROOT.glob("deploy/**/*.yml"), *ROOT.glob("deploy/**/*.yaml"),
                      *ROOT.glob("grafana/**/*.yml"), *PROMTOOL_TESTS.glob("*.yml")])


@pytest.mark.parametrize("path", DEPLOY_YAML, ids=lambda p: str(p.relative_to(ROOT)))
def test_deployment_yaml_file_parses(path: Path) -> None:
    assert yaml_docs(path), f"{path} is empty"


def test_dashboard_json_parses_and_has_unique_panel_ids() -> None:
    board = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    assert board["uid"] == render.DASHBOARD_UID


# --- one source of truth ------------------------------------------------------------------------

def test_rendered_dashboard_and_prometheusrule_are_up_to_date() -> None:
    for path, text in render.rendered().items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is stale: run python deploy/render.py"


def test_prometheusrule_holds_exactly_the_groups_of_the_prometheus_rule_files() -> None:
    (manifest,) = yaml_docs(K8S / "prometheusrule.yaml")
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["spec"]["groups"] == render.rule_groups()


def test_prometheus_config_loads_every_rule_file() -> None:
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    assert sorted(config["rule_files"]) == sorted(f"rules/{p.name}" for p in RULES_DIR.glob("*.yml"))


# --- names: only what the proxy exports ---------------------------------------------------------

def test_dashboard_and_rules_name_only_metrics_the_proxy_exports_or_rules_record() -> None:
    exported = exported_names()
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    expressions = [expr for _, expr in render.dashboard_expressions(render.dashboard())]
    expressions += [rule["expr"] for rule in rules()]
    expressions += [v["query"] for v in render.dashboard()["templating"]["list"] if v["type"] == "query"]
    unknown = {name for expr in expressions for name in names_in(expr)} - exported - recorded - {"up"}
    assert not unknown, f"not exported by proxy/observers/metrics.py nor recorded: {sorted(unknown)}"


def test_recording_rule_names_follow_level_metric_operation() -> None:
    for rule in rules():
        if "record" in rule:
            level, metric, operation = rule["record"].split(":")
            assert metric.startswith("llm_proxy_") and level and operation


def test_every_stop_reason_filter_in_the_rules_is_a_real_stop_reason() -> None:
    from proxy.record import STOP_REASONS

    texts = [rule["expr"] for rule in rules()] + [a["annotations"]["description"] for a in alerts()]
    texts += [expr for _, expr in render.dashboard_expressions(render.dashboard())]
    for text in texts:
        for match in re.findall(r'stop_reason[!=]~?"([^"]+)"', text) + re.findall(r"stop_reason=(\w+)", text):
            for reason in match.split("|"):
                assert reason in STOP_REASONS, f"{reason!r} in {text[:80]!r}"


def test_every_cause_and_outcome_filter_is_a_value_the_proxy_exports() -> None:
    from proxy.record import CAUSES, OUTCOMES

    texts = [rule["expr"] for rule in rules()]
    texts += [expr for _, expr in render.dashboard_expressions(render.dashboard())]
    for text in texts:
        for label, allowed in (("cause", CAUSES), ("outcome", OUTCOMES)):
            for match in re.findall(rf'\b{label}[!=]~?"([^"]+)"', text):
                for value in match.split("|"):
                    assert value in allowed, f"{label} {value!r} in {text[:80]!r}"


# --- alerts: actionable and unit-tested ----------------------------------------------------------

def test_every_alert_has_a_severity_summary_and_description() -> None:
    for alert in alerts():
        assert alert["labels"]["severity"] in ("critical", "warning", "info"), alert["alert"]
        assert alert["annotations"]["summary"].strip(), alert["alert"]
        assert len(alert["annotations"]["description"]) > 80, alert["alert"]


def test_every_panel_an_alert_points_to_exists_on_the_dashboard() -> None:
    titles = {panel["title"] for panel in render.dashboard()["panels"]}
    for alert in alerts():
        # Every quoted phrase of a description is a panel title.
        panels = set(re.findall(r'"([^"]+)"', alert["annotations"]["description"]))
        assert panels, f"{alert['alert']} names no dashboard panel"
        assert panels <= titles, f"{alert['alert']}: no such panels {panels - titles}"


def test_promtool_alert_cases_are_up_to_date_with_the_rules() -> None:
    assert alert_cases.OUTPUT.read_text() == alert_cases.rendered(), (
        "tests/deploy/promtool/alerts_test.yml is stale: run python3 -m tests.deploy.promtool.build_alert_cases")


def test_every_alert_has_promtool_tests_that_fire_and_that_do_not() -> None:
    fires: dict[str, int] = {}
    stays_quiet: dict[str, int] = {}
    for path in PROMTOOL_TESTS.glob("*.yml"):
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                counts = fires if check.get("exp_alerts") else stays_quiet
                counts[check["alertname"]] = counts.get(check["alertname"], 0) + 1
    for alert in alerts():
        assert fires.get(alert["alert"]), f"no promtool test where {alert['alert']} fires"
        assert stays_quiet.get(alert["alert"]), f"no promtool test where {alert['alert']} stays quiet"


# --- the dashboard ------------------------------------------------------------------------------

def test_dashboard_has_datasource_job_instance_model_and_admin_url_variables_used_by_its_queries() -> None:
    board = render.dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert set(variables) == {"datasource", "job", "instance", "model", "admin_url"}
    assert variables["job"]["current"]["value"] == "llm-diag-proxy"  # the default, not a hard-coded filter
    expressions = [expr for _, expr in render.dashboard_expressions(board)]
    assert all('job=~"$job"' in expr and 'instance=~"$instance"' in expr
               for expr in expressions if "llm_proxy_" in expr or "up{" in expr)
    assert 'job="' not in json.dumps(board)  # no job hard-coded anywhere
    assert sum('model=~"$model"' in expr for expr in expressions) >= 8


def test_every_share_on_the_dashboard_takes_both_sides_from_the_requests_counter() -> None:
    """A ratio of two series sets that appear at different times can pass 100% (the burst that
    moved traffic into a new concurrency bucket did): every share of answers is one counter over
    itself (with its `_created` time, which counts a series from its birth). The real Prometheus
    test checks the values."""
    for item in render.dashboard()["panels"]:
        for target in item.get("targets", []):
            if item["fieldConfig"]["defaults"]["unit"] == "percentunit" and "llm_proxy_requests" in target["expr"]:
                assert names_in(target["expr"]) == {"llm_proxy_requests_total", "llm_proxy_requests_created"}, \
                    item["title"]


def test_every_rate_of_the_proxys_counters_counts_series_from_their_birth() -> None:
    """rate() and increase() see no rise in a series first scraped above 0: every one of the
    proxy's counters and histograms in a rule or a panel goes with its `_created` time (the upstream's
    own counters, read from the server, have none)."""
    texts = [expr for _, expr in render.dashboard_expressions(render.dashboard())]
    texts += [rule["expr"] for rule in rules()]
    for expr in texts:
        for name in re.findall(r"(?:rate|increase)\((llm_proxy_\w+?)(?:_total|_sum|_count|_bucket)\{", expr):
            if name != "llm_proxy_upstream_preemptions":
                assert f"{name}_created" in expr, expr


def test_cause_and_outcome_panels_link_to_their_records_and_histograms_carry_exemplars() -> None:
    panels = {p["title"]: p for p in render.dashboard()["panels"]}
    links = {title: [link["url"] for link in p["fieldConfig"]["defaults"]["links"]]
             for title, p in panels.items() if "fieldConfig" in p}
    assert links["Truncation ratio by cause"] == ["${admin_url}/api/requests?cause=${__field.labels.cause}"]
    assert links["Who ended the answers"] == ["${admin_url}/api/requests?outcome=${__field.labels.outcome}"]
    assert any("stop_reason=" in url for urls in links.values() for url in urls)
    for title in ("Output tokens by concurrency", "Time to first token by concurrency"):
        assert all(t.get("exemplar") for t in panels[title]["targets"]), title


def test_gpu_panels_fall_back_on_the_dcgm_exporter() -> None:
    panels = {p["title"]: p for p in render.dashboard()["panels"]}
    memory = " ".join(t["expr"] for t in panels["In flight vs GPU memory"]["targets"])
    assert "DCGM_FI_DEV_FB_USED" in memory and "DCGM_FI_DEV_FB_FREE" in memory
    assert "DCGM_FI_DEV_GPU_UTIL" in " ".join(t["expr"] for t in panels["GPU utilization"]["targets"])


def test_dashboard_panels_do_not_overlap() -> None:
    taken: set[tuple[int, int]] = set()
    for panel in render.dashboard()["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        cells = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                 for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & taken, f"panel {panel['title']!r} overlaps another"
        taken |= cells


def test_dashboard_answers_the_questions_of_the_issue() -> None:
    titles = {panel["title"] for panel in render.dashboard()["panels"]}
    for title in ("Output tokens by concurrency", "Who ended the answers", "Truncation ratio by cause",
                  "Answers that hit the client's budget", "Answers cut by the serving layer (5m)",
                  "Cuts against in-flight and GPU memory", "Throughput",
                  "Time to first token by concurrency", "Inter-token latency by concurrency",
                  "In flight vs GPU memory", "Upstream KV cache and preemptions",
                  "Client disconnects and deadline hits"):
        assert title in titles


def test_in_flight_and_gpu_memory_share_one_panel_on_two_axes() -> None:
    (panel,) = [p for p in render.dashboard()["panels"] if p["title"] == "In flight vs GPU memory"]
    exprs = " ".join(t["expr"] for t in panel["targets"])
    assert "llm_proxy_in_flight" in exprs and "llm_proxy_gpu_memory_used_bytes" in exprs
    assert "llm_proxy_gpu_memory_free_bytes" in exprs
    (override,) = panel["fieldConfig"]["overrides"]
    assert {"id": "custom.axisPlacement", "value": "right"} in override["properties"]


def test_grafana_provisioning_points_at_the_dashboard_folder_and_prometheus() -> None:
    (datasources,) = yaml_docs(ROOT / "grafana/provisioning/datasources/prometheus.yml")
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["uid"] == "prometheus"
    (providers,) = yaml_docs(ROOT / "grafana/provisioning/dashboards/llm-diag-proxy.yml")
    (provider,) = providers["providers"]
    mounts = compose()["services"]["grafana"]["volumes"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in mounts


# --- docker compose -----------------------------------------------------------------------------

def test_compose_publishes_only_the_proxies_and_grafana_and_only_on_loopback() -> None:
    published = {name: svc["ports"] for name, svc in compose()["services"].items() if "ports" in svc}
    assert set(published) == {"proxy", "proxy-vllm", "proxy-cpu", "grafana"}
    for ports in published.values():
        for port in ports:
            assert default_of(port).startswith("127.0.0.1:"), port
    # The admin port too, so the dashboard's record links open in the browser on this machine.
    assert "127.0.0.1:9464:9464" in {default_of(port) for port in published["proxy-cpu"]}
    grafana = compose()["services"]["grafana"]["environment"]
    assert default_of(grafana["LLM_DIAG_ADMIN_URL"]) == "http://127.0.0.1:9464"


def test_compose_profiles_swap_the_inference_server_and_its_proxy() -> None:
    services = compose()["services"]
    assert services["ollama"]["profiles"] == services["proxy"]["profiles"] == ["ollama"]
    assert services["vllm"]["profiles"] == services["proxy-vllm"]["profiles"] == ["vllm"]
    assert services["ollama-cpu"]["profiles"] == services["proxy-cpu"]["profiles"] == ["cpu"]
    assert services["proxy"]["environment"]["LLM_DIAG_UPSTREAM"] == "http://ollama:11434"
    assert services["proxy-vllm"]["environment"]["LLM_DIAG_UPSTREAM"] == "http://vllm:8000"
    assert services["proxy-cpu"]["environment"]["LLM_DIAG_UPSTREAM"] == "http://ollama-cpu:11434"
    # Prometheus finds any proxy under the one name `proxy`; the CPU server answers to `ollama` too.
    for name in ("proxy", "proxy-vllm", "proxy-cpu"):
        assert services[name]["networks"]["default"]["aliases"] == ["proxy"], name
    assert services["ollama-cpu"]["networks"]["default"]["aliases"] == ["ollama"]
    for name in ("prometheus", "grafana", "alertmanager"):
        assert "profiles" not in services[name]
    assert services["vllm"]["image"].startswith("vllm/vllm-openai:")


def test_compose_reserves_gpus_for_the_gpu_profiles_only() -> None:
    services = compose()["services"]
    for name in ("ollama", "vllm", "proxy", "proxy-vllm"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], name
    for name in ("proxy", "proxy-vllm"):
        env = services[name]["environment"]
        assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility" and env["NVIDIA_VISIBLE_DEVICES"] == "all"
    for name in ("proxy", "proxy-vllm", "proxy-cpu"):
        env = services[name]["environment"]
        assert default_of(env["LLM_DIAG_ADMIN_LISTEN"]) == "0.0.0.0:9464"  # reached through the network
    for name in ("ollama-cpu", "proxy-cpu"):
        assert "deploy" not in services[name], name
        assert not any(key.startswith("NVIDIA_") for key in services[name].get("environment", {})), name
    command = services["proxy-cpu"]["command"]
    assert command[command.index("--gpu-poll-interval") + 1] == "0"


def test_compose_pins_every_image_and_needs_a_grafana_password() -> None:
    for name, service in compose()["services"].items():
        tag = default_of(service["image"]).rsplit(":", 1)[1]
        assert tag not in ("", "latest") and any(c.isdigit() for c in tag), (name, service["image"])
    password = compose()["services"]["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert password.startswith("${GRAFANA_ADMIN_PASSWORD:?"), password  # required, no weak default


def test_compose_prometheus_stores_exemplars() -> None:
    assert "--enable-feature=exemplar-storage" in compose()["services"]["prometheus"]["command"]


def test_compose_prometheus_takes_created_times_as_zero_samples() -> None:
    """Prometheus 2.55+ turns an OpenMetrics `_created` line into the zero a series started from."""
    service = compose()["services"]["prometheus"]
    assert "--enable-feature=created-timestamp-zero-ingestion" in service["command"]
    version = re.search(r"v(\d+)\.(\d+)", service["image"])
    assert version is not None and (int(version[1]), int(version[2])) >= (2, 55), service["image"]


def test_the_root_dockerignore_keeps_what_the_image_build_keeps() -> None:
    def rules(path: Path) -> list[str]:
        return [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    assert rules(ROOT / ".dockerignore") == rules(ROOT / "deploy/Dockerfile.dockerignore")


def test_compose_keeps_model_caches_and_prometheus_data_in_volumes() -> None:
    services = compose()["services"]
    assert "ollama-models:/root/.ollama" in services["ollama"]["volumes"]
    assert "hf-cache:/root/.cache/huggingface" in services["vllm"]["volumes"]
    assert "prometheus-data:/prometheus" in services["prometheus"]["volumes"]
    assert {"ollama-models", "hf-cache", "prometheus-data"} <= set(compose()["volumes"])


def test_compose_file_validates_against_the_compose_spec_schema() -> None:
    schema = json.loads((ROOT / "tests/fixtures/compose-spec.json").read_text())
    jsonschema.Draft201909Validator(schema).validate(compose())


def compose_command() -> list[str] | None:
    """`docker compose` where the plugin works, else the standalone `docker-compose`, else None."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=20)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def compose_config(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = compose_command()
    if command is None:
        pytest.skip("neither the docker compose plugin nor docker-compose is installed "
                    "(apt-get install docker-compose)")
    environment = {key: value for key, value in os.environ.items() if not key.startswith(("GRAFANA_", "LLM_DIAG_"))}
    return subprocess.run([*command, "-f", str(COMPOSE), *args], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env={**environment, **(env or {})}, check=False)


@pytest.mark.parametrize("profile", ["ollama", "vllm", "cpu"])
def test_docker_compose_config_accepts_each_profile(profile: str) -> None:
    result = compose_config("--profile", profile, "config", "-q", env={"GRAFANA_ADMIN_PASSWORD": "s3cret"})
    assert result.returncode == 0, result.stderr


def test_docker_compose_cpu_profile_reserves_no_device_anywhere() -> None:
    result = compose_config("--profile", "cpu", "config", env={"GRAFANA_ADMIN_PASSWORD": "s3cret"})
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    # The standalone docker-compose prints every service; the plugin only the active ones.
    active = {name: svc for name, svc in services.items() if set(svc.get("profiles", ["cpu"])) & {"cpu"}}
    assert {"ollama-cpu", "proxy-cpu", "prometheus", "grafana", "alertmanager"} <= set(active)
    for name, service in active.items():
        assert "devices" not in json.dumps(service.get("deploy", {})), name
        assert "runtime" not in service and "gpus" not in service, name


def test_docker_compose_refuses_to_start_grafana_without_a_password() -> None:
    result = compose_config("--profile", "cpu", "config", "-q")
    assert result.returncode != 0
    assert "set GRAFANA_ADMIN_PASSWORD to the Grafana admin password" in result.stderr


# --- the image ----------------------------------------------------------------------------------

def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "deploy/Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_image_is_slim_runs_as_non_root_and_checks_health_with_python() -> None:
    steps = dockerfile_instructions()
    bases = [arg for op, arg in steps if op == "FROM"]
    assert all("-slim" in base for base in bases)
    final = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM"):]
    users = [arg for op, arg in final if op == "USER"]
    assert users and users[-1] not in ("root", "0")
    (check,) = [arg for op, arg in final if op == "HEALTHCHECK"]
    assert "python" in check and "curl" not in check and "llm-diag-healthcheck" in check
    assert ("ENTRYPOINT", '["llm-diag-proxy"]') in final


def test_image_copies_only_files_that_exist_and_the_build_context_keeps() -> None:
    kept = [line[1:].rstrip("/") for line in (ROOT / "deploy/Dockerfile.dockerignore").read_text().splitlines()
            if line.startswith("!")]
    for op, arg in dockerfile_instructions():
        if op == "COPY" and not arg.startswith("--from"):
            *sources, _ = arg.split()
            for source in sources:
                assert source in kept, f"COPY {source}: excluded by deploy/Dockerfile.dockerignore"
                if source != "README.md":  # the lead's file; the build needs it (pyproject readme)
                    assert (ROOT / source).exists(), source


def test_healthcheck_probes_loopback_when_the_admin_port_binds_every_address() -> None:
    assert healthcheck.healthz_url("0.0.0.0:9464") == "http://127.0.0.1:9464/healthz"
    assert healthcheck.healthz_url(":9464") == "http://127.0.0.1:9464/healthz"
    assert healthcheck.healthz_url("[::]:9464") == "http://[::1]:9464/healthz"
    assert healthcheck.healthz_url("10.0.0.5:9000") == "http://10.0.0.5:9000/healthz"


async def run_healthcheck(listen: str) -> int:
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "deploy/healthcheck.py"), listen,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    return await asyncio.wait_for(process.wait(), timeout=20)


async def test_healthcheck_passes_against_a_real_admin_listener_and_fails_without_one(
        upstream: ScriptedUpstream, make_proxy: ProxyFactory) -> None:
    running = await make_proxy(upstream.url)
    admin = running.admin_url.removeprefix("http://")
    assert await run_healthcheck(admin) == 0
    await running.close()
    assert await run_healthcheck(admin) == 1


# --- Kubernetes ---------------------------------------------------------------------------------

def k8s_objects() -> dict[str, dict[str, Any]]:
    (kustomization,) = yaml_docs(K8S / "kustomization.yaml")
    objects: dict[str, dict[str, Any]] = {}
    for resource in kustomization["resources"]:
        for doc in yaml_docs(K8S / resource):
            objects[doc["kind"]] = doc
    return objects


def test_k8s_core_manifests_validate_against_the_kubernetes_schemas() -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate (offline Kubernetes JSON schemas)")
    objects = k8s_objects()
    for kind in ("Deployment", "Service", "PersistentVolumeClaim", "NetworkPolicy"):
        kubernetes_validate.validate(objects[kind], "1.30", strict=True)


CRD_SCHEMAS = Path(os.environ.get("LLM_DIAG_CACHE", Path.home() / ".cache/llm-diag-proxy")) / (
    "prometheus-operator-schemas-6.0.0/node_modules/@kubernetes-models/prometheus-operator")


def validate_crds(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each object checked against the Prometheus Operator's CRD schemas (tools/setup_crd_schemas.sh)."""
    if shutil.which("node") is None:
        pytest.skip("node is not installed (apt-get install -y nodejs npm): no CRD schema check")
    if not CRD_SCHEMAS.is_dir():
        pytest.skip(f"no CRD schemas at {CRD_SCHEMAS}: run tools/setup_crd_schemas.sh")
    result = subprocess.run(["node", str(ROOT / "tests/support/validate_crds.mjs"), str(CRD_SCHEMAS)],
                            input=json.dumps(objects), capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    checked: list[dict[str, Any]] = json.loads(result.stdout)
    return checked


def test_k8s_servicemonitor_and_prometheusrule_validate_against_the_operators_crd_schemas() -> None:
    objects = k8s_objects()
    checked = validate_crds([objects["ServiceMonitor"], objects["PrometheusRule"]])
    assert [(c["kind"], c["errors"]) for c in checked] == [("ServiceMonitor", []), ("PrometheusRule", [])]
    # The check has teeth: a mistyped field and a bad duration are refused.
    monitor = objects["ServiceMonitor"]
    broken_monitor = {**monitor, "spec": {**monitor["spec"], "endpoints": "metrics"}}
    rule = objects["PrometheusRule"]
    group = {**rule["spec"]["groups"][0], "rules": [{"alert": "X", "expr": "up", "for": "5 minutes"}]}
    broken_rule = {**rule, "spec": {"groups": [group]}}
    refused = validate_crds([broken_monitor, broken_rule])
    assert all(c["errors"] for c in refused), refused


def test_k8s_service_selects_the_pods_and_the_servicemonitor_selects_the_service() -> None:
    objects = k8s_objects()
    pod_labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
    # The pods are vLLM's; the proxy is their sidecar and the Service is the proxy's.
    assert pod_labels["app.kubernetes.io/name"] == "vllm"
    assert pod_labels["app.kubernetes.io/part-of"] == "llm-diag-proxy"
    assert objects["Deployment"]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert objects["PersistentVolumeClaim"]["metadata"]["labels"]["app.kubernetes.io/name"] == "vllm"
    service = objects["Service"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["metadata"]["name"] == "llm-diag-proxy"  # the job label the rules expect
    assert service["metadata"]["labels"]["app.kubernetes.io/name"] == "llm-diag-proxy"
    monitor = objects["ServiceMonitor"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert not monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    service_ports = {port["name"] for port in service["spec"]["ports"]}
    assert {endpoint["port"] for endpoint in monitor["spec"]["endpoints"]} <= service_ports
    containers = {c["name"]: c for c in objects["Deployment"]["spec"]["template"]["spec"]["containers"]}
    container_ports = {port["name"] for port in containers["llm-diag-proxy"]["ports"]}
    assert {port["targetPort"] for port in service["spec"]["ports"]} <= container_ports


def test_k8s_admin_port_is_open_to_prometheus_only_and_its_api_needs_the_secret_token() -> None:
    objects = k8s_objects()
    policy = objects["NetworkPolicy"]["spec"]
    pod_labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    rules = {rule["ports"][0]["port"]: rule for rule in policy["ingress"]}
    assert set(rules) == {"http", "metrics"}
    assert "from" not in rules["http"]  # clients: anyone who may reach the Service
    (source,) = rules["metrics"]["from"]
    assert source["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    assert "namespaceSelector" in source
    containers = {c["name"]: c for c in objects["Deployment"]["spec"]["template"]["spec"]["containers"]}
    env = {e["name"]: e for e in containers["llm-diag-proxy"]["env"]}
    secret = env["LLM_DIAG_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert secret == {"name": "llm-diag-proxy-admin", "key": "token", "optional": False}


def test_k8s_readiness_does_not_wait_on_the_upstream_and_images_are_pinned() -> None:
    containers = {c["name"]: c for c in k8s_objects()["Deployment"]["spec"]["template"]["spec"]["containers"]}
    probe = containers["llm-diag-proxy"]["readinessProbe"]["httpGet"]
    assert probe["path"] == "/readyz"  # not ?upstream=required: a slow vLLM keeps the replica in service
    tag = containers["vllm"]["image"].rsplit(":", 1)[1]
    assert tag != "latest" and any(c.isdigit() for c in tag)
    (kustomization,) = yaml_docs(K8S / "kustomization.yaml")
    assert all(image["newTag"] != "latest" for image in kustomization["images"])


def test_k8s_sidecar_is_the_only_way_in_and_runs_locked_down() -> None:
    containers = {c["name"]: c for c in k8s_objects()["Deployment"]["spec"]["template"]["spec"]["containers"]}
    vllm_args = containers["vllm"]["args"]
    assert vllm_args[vllm_args.index("--host") + 1] == "127.0.0.1"
    env = {e["name"]: e.get("value") for e in containers["llm-diag-proxy"]["env"]}
    assert env["LLM_DIAG_UPSTREAM"] == "http://127.0.0.1:8000"
    security = containers["llm-diag-proxy"]["securityContext"]
    assert security["runAsNonRoot"] and security["readOnlyRootFilesystem"]
    assert not security["allowPrivilegeEscalation"] and security["capabilities"]["drop"] == ["ALL"]
    assert containers["llm-diag-proxy"]["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_compose_postgres_profile_gives_a_small_fleet_one_history_unpublished() -> None:
    services = compose()["services"]
    database = services["postgres"]
    assert database["profiles"] == ["postgres"] and "ports" not in database
    assert default_of(database["environment"]["POSTGRES_PASSWORD"]) == ""  # no weak default: the image refuses
    assert "postgres-data:/var/lib/postgresql/data" in database["volumes"] and "postgres-data" in compose()["volumes"]
    for name in ("proxy", "proxy-vllm", "proxy-cpu"):
        env = services[name]["environment"]
        assert default_of(env["LLM_DIAG_HISTORY"]) == "/var/lib/llm-diag-proxy/history.sqlite3", name
        assert env["PGPASSWORD"] == "${LLM_DIAG_DB_PASSWORD:-}" and "LLM_DIAG_INSTANCE" in env, name


def test_docker_compose_config_accepts_the_postgres_profile_beside_a_server() -> None:
    result = compose_config("--profile", "cpu", "--profile", "postgres", "config", "-q",
                            env={"GRAFANA_ADMIN_PASSWORD": "s3cret", "LLM_DIAG_DB_PASSWORD": "db-s3cret",
                                 "LLM_DIAG_HISTORY": "postgresql://llm_diag@postgres:5432/llm_diag"})
    assert result.returncode == 0, result.stderr


def test_k8s_sidecar_takes_the_fleets_history_from_an_optional_secret_and_names_its_pod() -> None:
    deployment = next(d for d in yaml.safe_load_all((ROOT / "deploy/k8s/vllm-with-proxy.yaml").read_text())
                      if d["kind"] == "Deployment")
    (sidecar,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "llm-diag-proxy"]
    env = {item["name"]: item for item in sidecar["env"]}
    for name, key in (("LLM_DIAG_HISTORY", "url"), ("PGPASSWORD", "password")):
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "llm-diag-proxy-history", "key": key, "optional": True}, name
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["LLM_DIAG_INSTANCE"]["value"] == "$(POD_NAME):8080"
    assert list(env).index("POD_NAME") < list(env).index("LLM_DIAG_INSTANCE")  # $(VAR) sees earlier ones only


def test_every_alert_is_in_the_deploy_docs_table() -> None:
    """docs/deploy.md's alert table names every alert the rules define, one row each."""
    table = [line for line in (ROOT / "docs/deploy.md").read_text().splitlines() if line.startswith("| `LLMProxy")]
    named = {name for line in table for name in re.findall(r"`(LLMProxy\w+)`", line.split("|")[1])}
    alerts = {rule["alert"] for rule in rules() if "alert" in rule}
    assert named == alerts, (sorted(alerts - named), sorted(named - alerts))


def test_deploy_render_prometheus_writes_a_config_for_targets_outside_compose() -> None:
    config = render.prometheus_config(["10.0.0.5:9464"], ["10.0.0.5:8000"], ["127.0.0.1:9093"])
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["llm-diag-proxy"]["static_configs"] == [{"targets": ["10.0.0.5:9464"]}]
    assert jobs["vllm"]["static_configs"] == [{"targets": ["10.0.0.5:8000"]}]
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["127.0.0.1:9093"]
    assert all(Path(path).is_absolute() and Path(path).exists() for path in config["rule_files"])
    bare = render.prometheus_config(["127.0.0.1:9464"])
    assert "alerting" not in bare and [job["job_name"] for job in bare["scrape_configs"]] == ["llm-diag-proxy"]
