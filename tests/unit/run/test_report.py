"""The HTML report of a real run: every attempt, its timeline, its verdict."""

import re

import pytest

from eyrie_testing import REPO, eyrie


@pytest.mark.usefixtures("real_cgroups")
def test_report_shows_every_attempt_with_a_timeline(tmp_path):
    pipeline = tmp_path / "p.yaml"
    scenario = REPO / "tests" / "scenarios" / "scenario.py"
    pipeline.write_text(f"""
steps:
  - name: grows
    command: [python3, {scenario}, oom]
    memory: 64MiB
  - name: fine
    command: [python3, {scenario}, allocate, "30"]
    memory: 96MiB
    outputs: [result.txt]
""")
    eyrie("run", str(pipeline), "--run-dir", str(tmp_path / "run"))
    result = eyrie("report", "--run-dir", str(tmp_path / "run"), check=True)
    page = (tmp_path / "run" / "report.html").read_text()
    assert result.stdout.strip().endswith("report.html")
    assert page.count('<svg class="run-chart"') == 1
    attempt_charts = re.findall(r'aria-label="memory of \S+ attempt \d"', page)
    assert len(attempt_charts) + page.count("no timeline samples") == 2
    assert "OOM-killed" in page and "oom_kill went 0→1" in page
    assert re.search(r"<td class='verdict'[^>]*>succeeded</td>", page)
    assert "<script" not in page


def test_report_without_ledger(tmp_path):
    result = eyrie("report", "--run-dir", str(tmp_path))
    assert result.returncode == 2 and "no ledger" in result.stderr
