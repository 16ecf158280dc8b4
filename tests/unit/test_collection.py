"""Every test file under tests/ is collected: a file pytest never runs says "tested" and proves nothing.

pytest skips folders named like build outputs (`build`, `dist`, dot-folders) by default, and
a file that fails to import is reported as an error only if anyone reads it; this check
runs a real collection of the whole tree, with no marker filter, and compares it with the
files on disk.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from eyrie_testing import REPO


def uncollected_test_files(root: Path) -> list[str]:
    """``test_*.py`` files under ``root/tests`` that ``pytest --collect-only`` does not collect."""
    collection = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "", "-p", "no:cacheprovider", "tests"],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=300,
    )
    collected = {line.split("::", 1)[0] for line in collection.stdout.splitlines() if "::" in line}
    on_disk = {str(path.relative_to(root)) for path in (root / "tests").rglob("test_*.py")}
    return sorted(on_disk - collected)


def test_every_test_file_under_tests_is_collected():
    assert uncollected_test_files(REPO) == []


def test_a_test_file_in_a_folder_pytest_skips_is_found(tmp_path):
    for folder in ("unit", "build"):
        (tmp_path / "tests" / folder).mkdir(parents=True)
        (tmp_path / "tests" / folder / f"test_in_{folder}.py").write_text("def test_it():\n    pass\n")
    assert uncollected_test_files(tmp_path) == ["tests/build/test_in_build.py"]
