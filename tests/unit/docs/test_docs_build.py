"""The documentation pages build strictly (mkdocs.yml: every link, anchor and nav entry checked, a
warning an error), in the order a user works in; the README stays the one screen that leads there;
and the strict build can fail: a broken anchor, a missing page or a page left out of the nav stops it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eyrie_testing import DOCS, REPO

CONFIG = REPO / "mkdocs.yml"
README = (REPO / "README.md").read_text(encoding="utf-8")
README_LINES = 60  # one screen
# Running a pipeline; the ledger; each step; the GPU host; Slurm; provisioning; the build; the layout.
USER_ORDER = [
    "index.md",
    "running.md",
    "ledger.md",
    "steps/prep.md",
    "steps/generate.md",
    "steps/train.md",
    "steps/accept.md",
    "gpu-host.md",
    "slurm.md",
    "provisioning.md",
    "build.md",
    "layout.md",
    "tests.md",
]


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of ``config`` into ``site``, as a user runs it (the theme's notice off)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(config),
            "--site-dir",
            str(site),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=config.parent,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


def nav_pages(nav: list) -> list[str]:
    """The pages of a mkdocs nav, in its order, sections opened."""
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages.extend(nav_pages(value) if isinstance(value, list) else [value])
    return pages


def test_the_docs_build_strictly(tmp_path):
    result = mkdocs_build(CONFIG, tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    assert (tmp_path / "site" / "index.html").is_file() and (tmp_path / "site" / "report-demo.png").is_file()


def test_every_page_is_in_the_nav_in_the_order_a_user_works_in():
    config = yaml.safe_load(CONFIG.read_text(encoding="utf-8"))
    assert config["docs_dir"] == "docs" and config["strict"] is True
    assert config["validation"]["links"]["anchors"] == "warn"  # strict: an error
    pages = nav_pages(config["nav"])
    assert pages == USER_ORDER
    assert sorted(pages) == sorted(str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md"))


@pytest.mark.parametrize(
    ("page", "added", "says"),
    [
        ("running.md", "\nSee [the verdicts](ledger.md#no-such-heading).\n", "no-such-heading"),
        ("running.md", "\nSee [the verdicts](#no-such-heading).\n", "no-such-heading"),
        ("ledger.md", "\nSee [a page](no-such-page.md).\n", "no-such-page.md"),
        ("left-out.md", "# A page no nav lists\n", "left-out.md"),
    ],
    ids=["anchor-on-another-page", "anchor-on-its-page", "missing-page", "page-not-in-nav"],
)
def test_a_broken_link_or_anchor_fails_the_strict_build(tmp_path, page, added, says):
    shutil.copy(CONFIG, tmp_path / "mkdocs.yml")
    shutil.copytree(DOCS, tmp_path / "docs")
    with open(tmp_path / "docs" / page, "a", encoding="utf-8") as text:
        text.write(added)
    result = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    said = result.stdout + result.stderr
    assert result.returncode != 0 and "Aborted with 1 warnings in strict mode" in said, said
    assert said.count("WARNING") == 1 and says in said[said.index("WARNING") :], said


def test_the_readme_is_one_screen_that_leads_to_the_docs():
    assert len(README.splitlines()) <= README_LINES, f"{len(README.splitlines())} lines"
    commands = [
        "make demo",
        "make test",
        "make test-slow",
        "make provision host=",
        "make images",
        "docker compose -f compose/compose.yaml up pipeline",
        ".venv/bin/mkdocs serve",
    ]
    assert [command for command in commands if command not in README] == []
    links = {link for link in re.findall(r"\]\(([^)#\s]+)[^)]*\)", README) if "://" not in link}
    assert [link for link in links if not (REPO / link).is_file()] == []
    assert {f"docs/{page}" for page in USER_ORDER} <= links
    assert "benchmarks/README.md" in links
