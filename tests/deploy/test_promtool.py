"""The Prometheus and Alertmanager files as the real tools read them: promtool and amtool.

Skipped, with the reason, only where the binaries are absent (Debian: apt-get install prometheus
prometheus-alertmanager); CI installs them.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROMTOOL = shutil.which("promtool")
AMTOOL = shutil.which("amtool")

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)"),
]


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def test_prometheus_config_passes_promtool_check_config() -> None:
    result = promtool("check", "config", "prometheus.yml", cwd=ROOT / "deploy/prometheus")
    assert result.returncode == 0, result.stdout + result.stderr


def test_rule_files_pass_promtool_check_rules() -> None:
    files = sorted(str(p) for p in (ROOT / "deploy/prometheus/rules").glob("*.yml"))
    result = promtool("check", "rules", *files)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheusrule_spec_passes_promtool_check_rules(tmp_path: Path) -> None:
    (manifest,) = yaml.safe_load_all((ROOT / "deploy/k8s/prometheusrule.yaml").read_text())
    rule_file = tmp_path / "from-prometheusrule.yml"
    rule_file.write_text(yaml.safe_dump(manifest["spec"]))
    result = promtool("check", "rules", str(rule_file))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_of_every_alert_and_recording_rule_pass() -> None:
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests/deploy/promtool").glob("*.yml"))
    assert files
    result = promtool("test", "rules", *files)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(AMTOOL is None, reason="amtool not installed (apt-get install prometheus-alertmanager)")
def test_alertmanager_config_passes_amtool_check_config() -> None:
    assert AMTOOL is not None
    result = subprocess.run([AMTOOL, "check-config", str(ROOT / "deploy/alertmanager/alertmanager.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
