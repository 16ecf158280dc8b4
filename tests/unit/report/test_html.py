"""The HTML report of a real run: every attempt, its timeline, its verdict."""

import re
import sys
import time

import pytest

from eyrie_testing import REPO, attempts_json, eyrie
from pipeline.memory import GIB
from pipeline.report.chart import RUNNING_COLOR, esc
from pipeline.report.html import render
from pipeline.report.neighbours import neighbours
from pipeline.run.ledger import HostSample, Ledger


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


# Grows 10 MiB every 0.1 s until its 100 MiB limit kills it, about a second in.
SHORT_OOM = """
steps:
  - name: grows
    command:
      - PYTHON
      - -c
      - |
        import time
        held = []
        while True:
            held.append(b"x" * (10 << 20))
            time.sleep(0.1)
    memory: 100MiB
"""


def _first_and_highest(d: str) -> tuple[int, int]:
    """The first and the highest (least) y of an SVG path's outline."""
    ys = [int(v) for v in re.findall(r"(?:,|V)(\d+)", d)]
    return ys[0], min(ys)


@pytest.mark.usefixtures("real_cgroups")
def test_the_report_of_a_one_second_oom_draws_the_memory_growing_from_the_start(tmp_path):
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(SHORT_OOM.replace("PYTHON", sys.executable))
    eyrie("run", str(pipeline), "--run-dir", str(tmp_path / "run"))
    (attempt,) = attempts_json(tmp_path / "run")
    assert attempt["verdict"] == "oom_killed" and attempt["wall_s"] < 5, attempt
    ledger = Ledger(tmp_path / "run", create=False)
    points = ledger.timeline(ledger.attempts()[0].id)
    ledger.close()
    # Read from its start: the first reading within 0.1 s, long before it filled its limit.
    assert points[0][0] <= 0.1 and points[0][1] < attempt["peak_bytes"] / 2, points
    # It climbs (a last reading may come after the kill, when the cgroup is already near empty).
    assert len(points) >= 4 and max(p[1] for p in points) > 4 * points[0][1], points
    eyrie("report", "--run-dir", str(tmp_path / "run"), check=True)
    page = (tmp_path / "run" / "report.html").read_text()
    # Its own chart: the line starts low and climbs to the peak, not flat at the peak from 0:00.
    (total,) = re.findall(rf'<path d="([^"]+)" fill="none" stroke="{RUNNING_COLOR}"', page)
    first, highest = _first_and_highest(total)
    assert first - highest > 100, total  # of the 138 px between 0 and the 100 MiB limit
    # The run chart: its band is filled as the memory grew, not solid from its start.
    (band,) = re.findall(r'<path class="area" data-series="steps-grows" d="([^"]+)"', page)
    first, highest = _first_and_highest(band)
    assert first - highest > 80, band  # of the 160 px of the steps panel


def _a_ledger(run_dir):
    ledger = Ledger(run_dir)
    ledger.start_run("r1", "p.yaml", "local", ["a"], 2**30, "MemAvailable")
    ledger.end_run("r1", "succeeded")
    ledger.close()


def test_report_out_naming_a_folder_is_refused_and_the_folder_kept(tmp_path):
    _a_ledger(tmp_path / "run")
    precious = tmp_path / "precious"
    (precious / "deep").mkdir(parents=True)
    (precious / "deep" / "keep.txt").write_text("mine")
    result = eyrie("report", "--run-dir", str(tmp_path / "run"), "--out", f"{precious}/")
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"--out {precious} is a folder" in line and "report.html" in line
    assert (precious / "deep" / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in precious.iterdir()) == ["deep"]


def test_report_never_replaces_a_folder_named_like_it(tmp_path):
    """A run directory from before such names were refused: a step's folder named report.html."""
    _a_ledger(tmp_path)
    (tmp_path / "report.html").mkdir()
    (tmp_path / "report.html" / "out.txt").write_text("a step's output")
    result = eyrie("report", "--run-dir", str(tmp_path))
    assert result.returncode == 2 and "is a folder" in result.stderr
    assert (tmp_path / "report.html" / "out.txt").read_text() == "a step's output"


def _a_run_of_crashes(run_dir, crashes: int) -> None:
    """A server beside ``crashes`` jobs that each crashed, with a minute of host samples."""
    ledger = Ledger(run_dir)
    t0 = time.time() - 120
    jobs = [f"job{n}" for n in range(crashes)]
    ledger.start_run("r1", "p.yaml", "local", ["server", *jobs], 15 * GIB, "MemAvailable")
    ended = {"server": ("succeeded", "exit 0", 60, 0, None)}
    ended |= {job: ("crashed", "signal 11", 5 + n, None, 11) for n, job in enumerate(jobs)}
    for step, (verdict, reason, seconds, exit_code, signal) in ended.items():
        attempt = ledger.begin_attempt(
            run_id="r1",
            step=step,
            attempt=1,
            executor="local",
            limit_bytes=2 * GIB,
            limit_reason=None,
            argv=["x"],
            image=None,
            commit_id=None,
            host_mem_available=15 * GIB,
            host_mem_total=16 * GIB,
        )
        fields = {"started_at": t0, "ended_at": t0 + seconds, "peak_bytes": GIB, "anon_peak_bytes": GIB}
        ledger.end_attempt(
            attempt,
            verdict=verdict,
            reason=reason,
            fields={**fields, "exit_code": exit_code, "signal": signal},
            timeline=[(float(s), GIB, GIB) for s in range(1, seconds + 1)],
        )
    for s in range(61):
        ledger.add_host_sample("r1", HostSample(t0 + s, 16 * GIB, 8 * GIB, 8 * GIB))
    ledger.end_run("r1", "failed")
    ledger.close()


def test_the_report_builds_each_run_s_timeline_once_however_many_attempts_failed(tmp_path, monkeypatch):
    """Each failed attempt's neighbours are read off its run's timeline, which reads every sample of
    the run: built once per attempt, a long run with many failures made the report slow."""
    _a_run_of_crashes(tmp_path, crashes=4)
    ledger = Ledger(tmp_path, create=False)
    told = {row.id: neighbours(ledger, row) for row in ledger.attempts()}
    built, read_host = [], Ledger.host_samples

    def host_samples(self: Ledger, run_id: str) -> list[HostSample]:
        built.append(run_id)  # building a run's timeline starts by reading its host samples
        return read_host(self, run_id)

    monkeypatch.setattr(Ledger, "host_samples", host_samples)
    page = render(ledger, tmp_path)
    ledger.close()
    assert built == ["r1"]
    # and each failed attempt is still told what ran beside it, as `eyrie explain` tells it
    assert sum(bool(lines) for lines in told.values()) == 4
    for lines in told.values():
        assert all(esc(line) in page for line in lines), lines
