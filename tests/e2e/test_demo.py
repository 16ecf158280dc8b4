"""The demo end to end: `eyrie run pipeline/embedded/demo.yaml`, a draft for the real
SmolLM2-135M-Instruct, every step succeeds and accept prints MT-bench's accept length and the
real speedup.

The default run is the same file made short by its own settings (8 prompts answered, 4 training
steps, 1 MT-bench prompt): its length adds nothing the shorter run does not check. The whole demo,
as `make demo` runs it, is a slow test.
"""

import re
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
    logs = run_dir / ".eyrie" / "logs"
    train_log = (logs / "train" / "attempt-1.stdout.log").read_text()
    assert f"step {settings.get('EYRIE_DEMO_MAX_STEPS', '60')}/" in train_log
    accept_log = "".join(
        (logs / "accept" / f"attempt-1.{out}.log").read_text() for out in ("stdout", "stderr")
    )
    assert re.search(r"accept \(chain\) mtbench: accept length \d\.\d+ .* \(\d+\.\d+x\)", accept_log), (
        accept_log
    )
    assert "SmolLM2-135M-Instruct ready" in (logs / "target" / "attempt-1.stdout.log").read_text()
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
def test_the_demo_made_short_succeeds_and_resumes(tmp_path):
    run_demo(
        tmp_path, {"EYRIE_DEMO_PROMPTS": "8", "EYRIE_DEMO_MAX_STEPS": "4", "EYRIE_DEMO_ACCEPT_PROMPTS": "1"}
    )


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.usefixtures("real_cgroups")
def test_the_whole_demo_as_make_demo_runs_it_succeeds_and_resumes(tmp_path):
    run_demo(tmp_path, {})
