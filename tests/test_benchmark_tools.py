"""The benchmarks' own command lines: a bad argument is one line and exit code 2, before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("grid", ["1,2", "a,b,c", ""])
def test_path_budget_refuses_a_grid_it_cannot_read(grid: str) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "path_budget.py"), "--grid", grid],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("path_budget: --grid takes rows of")


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--seconds", "0"], ["--seconds", "nan"], ["--grid", "0,-1,0"]])
def test_path_budget_refuses_counts_it_cannot_run(argv: list[str]) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "path_budget.py"), *argv],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("path_budget: --rounds takes 1 or more")


def test_path_budget_refuses_a_tree_that_is_not_the_proxy(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "path_budget.py"), "--proxy", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == f"path_budget: {tmp_path} is not a source tree of the proxy\n"
