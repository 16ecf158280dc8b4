"""The embedded default end to end: `eyrie run pipeline/embedded/demo.yaml`, every step succeeds."""

import pytest
import yaml

from eyrie_testing import REPO, attempts_json, check_run_chart, eyrie, screenshot

DEMO = REPO / "pipeline" / "embedded" / "demo.yaml"


@pytest.mark.timeout(2400)
@pytest.mark.usefixtures("real_cgroups")
def test_demo_pipeline_succeeds_and_resumes(tmp_path):
    run_dir = tmp_path / "demo"
    result = eyrie("run", str(DEMO), "--run-dir", str(run_dir), timeout=2100)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    steps = [s["name"] for s in yaml.safe_load(DEMO.read_text())["steps"]]
    attempts = attempts_json(run_dir)
    assert {a["step"] for a in attempts} == set(steps)
    assert all(a["verdict"] == "succeeded" for a in attempts), [(a["step"], a["reason"]) for a in attempts]
    status = eyrie("status", "--run-dir", str(run_dir), check=True).stdout
    assert all(step in status for step in steps)
    # The report's run chart as a browser draws it: the host, the budget, and the long steps
    # (a step of a few seconds is a few pixels wide in a run of minutes: it is in the markup).
    eyrie("report", "--run-dir", str(run_dir), check=True)
    page = (run_dir / "report.html").read_text()
    check_run_chart(page, screenshot(run_dir / "report.html", tmp_path / "report.png"), ["generate", "train"])
    assert all(f'data-series="steps-{step}"' in page for step in steps)
    again = eyrie("run", str(DEMO), "--run-dir", str(run_dir), check=True)
    assert again.stdout.count("skipped") == len(steps)
