"""The README a newcomer finishes, and the site the rest lives in."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_the_readme_is_at_most_25000_characters() -> None:
    assert len(README) <= 25_000, len(README)


def test_the_readmes_first_two_commands_install_and_run_the_main_job_then_the_tests() -> None:
    commands = re.findall(r"```sh\n(.*?)\n```", README, re.S)
    assert commands[:2] == ["python3 -m pip install . && llm-diag-proxy demo",
                            "python3 -m pip install -e '.[test]' && python3 -m pytest"]


def test_every_page_is_in_the_sites_navigation_and_every_readme_link_finds_its_page() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def pages(nav: object) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        if isinstance(nav, dict):
            return [p for value in nav.values() for p in pages(value)]
        assert isinstance(nav, list)
        return [p for item in nav for p in pages(item)]

    listed = pages(config["nav"])
    assert sorted(listed) == sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    for target in re.findall(r"\]\((docs/[^)#]+)", README):
        assert (ROOT / target).is_file(), target
