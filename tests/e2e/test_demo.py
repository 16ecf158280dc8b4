"""The embedded default end to end: `eyrie run pipeline/embedded/demo.yaml`, every step succeeds.

The default run trains for 12 of the demo's 40 steps (a checkpoint at step 10 included): the
training is most of the demo's 8 minutes on two cores, and its length adds nothing the shorter
run does not check. The whole demo, as `make demo` runs it, is a slow test.
"""

from pathlib import Path

import pytest
import yaml

from eyrie_testing import REPO, attempts_json, check_run_chart, eyrie, screenshot

DEMO = REPO / "pipeline" / "embedded" / "demo.yaml"


def run_demo(tmp_path: Path, settings: dict[str, str]) -> None:
    """The demo into a run directory, every step succeeded; its status, its report's run chart as a
    browser draws it, and a rerun that skips every step."""
    run_dir = tmp_path / "demo"
    result = eyrie("run", str(DEMO), "--run-dir", str(run_dir), timeout=2100, settings=settings)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    steps = [s["name"] for s in yaml.safe_load(DEMO.read_text())["steps"]]
    attempts = attempts_json(run_dir)
    assert {a["step"] for a in attempts} == set(steps)
    assert all(a["verdict"] == "succeeded" for a in attempts), [(a["step"], a["reason"]) for a in attempts]
    train_log = (run_dir / ".eyrie" / "logs" / "train" / "attempt-1.stdout.log").read_text()
    assert f"step {settings.get('EYRIE_DEMO_MAX_STEPS', '40')}/" in train_log
    status = eyrie("status", "--run-dir", str(run_dir), check=True).stdout
    assert all(step in status for step in steps)
    # The report's run chart as a browser draws it: the host, the budget, and the long steps
    # (a step of a few seconds is a few pixels wide in a run of minutes: it is in the markup).
    eyrie("report", "--run-dir", str(run_dir), check=True, settings=settings)
    page = (run_dir / "report.html").read_text()
    check_run_chart(page, screenshot(run_dir / "report.html", tmp_path / "report.png"), ["generate", "train"])
    assert all(f'data-series="steps-{step}"' in page for step in steps)
    again = eyrie("run", str(DEMO), "--run-dir", str(run_dir), check=True, settings=settings)
    assert again.stdout.count("skipped") == len(steps)


@pytest.mark.timeout(1200)
@pytest.mark.usefixtures("real_cgroups")
def test_the_demo_with_shorter_training_succeeds_and_resumes(tmp_path):
    run_demo(tmp_path, {"EYRIE_DEMO_MAX_STEPS": "12"})


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.usefixtures("real_cgroups")
def test_the_whole_demo_as_make_demo_runs_it_succeeds_and_resumes(tmp_path):
    run_demo(tmp_path, {})
