"""The run chart of `eyrie report`, drawn by a real browser: every series is there, with its axes."""

from __future__ import annotations

import re
import sqlite3
import time
from pathlib import Path

import pytest

from eyrie_testing import chart_pixels, check_run_chart, eyrie, overflowing_text, screenshot
from pipeline.memory import parse_size
from pipeline.report.chart import (
    AVAILABLE_COLOR,
    BUDGET_COLOR,
    CRASH_COLOR,
    FAILED_COLOR,
    MIB,
    OOM_COLOR,
    VERDICT_COLORS,
    Scale,
    byte_label,
    byte_ticks,
    time_label,
    time_ticks,
    y_axis,
)
from pipeline.report.follow import view
from pipeline.report.run_chart import LEFT, RIGHT, WIDTH
from pipeline.run.ledger import LEDGER_NAME, HostSample, Ledger

GIB = 2**30

STEPS = ["server", "prep-a", "prep-b", "grows"]


@pytest.fixture(scope="module")
def report(neighbours_run: Path) -> str:
    eyrie("report", "--run-dir", str(neighbours_run), check=True)
    return (neighbours_run / "report.html").read_text()


def test_the_run_chart_draws_the_host_every_step_the_budget_and_each_death(report, neighbours_run, tmp_path):
    png = screenshot(neighbours_run / "report.html", tmp_path / "report.png")
    check_run_chart(report, png, STEPS)
    marks = chart_pixels(
        png,
        report,
        {
            "OOM kill": OOM_COLOR,
            "crash": CRASH_COLOR,
            "succeeded bar": VERDICT_COLORS["succeeded"],
            "completed_then_crashed bar": VERDICT_COLORS["completed_then_crashed"],
            "failed bars": FAILED_COLOR,
        },
    )
    assert all(n >= 100 for n in marks.values()), marks
    # Each death is marked at its step and its kind; each attempt has its bar.
    events = set(re.findall(r'<g class="event" data-what="([^"]+)" data-step="([^"]+)"', report))
    assert events == {("OOM kill", "grows"), ("crash", "prep-a"), ("crash", "prep-b")}
    bars = re.findall(r'<g class="attempt" data-step="([^"]+)" data-verdict="([^"]+)"', report)
    assert sorted(bars) == sorted(
        [
            ("server", "succeeded"),
            ("prep-a", "completed_then_crashed"),
            ("prep-b", "crashed"),
            ("grows", "oom_killed"),
        ]
    )
    # Axes a value can be read from: sizes with units on y, elapsed time on x.
    chart = report[report.index('<svg class="run-chart"') : report.index("</svg>")]
    sizes = re.findall(r'text-anchor="end">(\d+(?:\.\d)? [KMGT]iB)</text>', chart)
    assert len(sizes) >= 6 and any("GiB" in s for s in sizes) and any("MiB" in s for s in sizes), sizes
    assert ">0:00<" in chart and "elapsed (m:ss) since" in chart


def test_the_report_is_one_file_with_no_script_and_nothing_fetched(report):
    assert "<script" not in report.lower()
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", report)
    assert "url(" not in report and "@import" not in report


def test_the_check_fails_when_a_series_is_missing_or_the_chart_is_empty(report, tmp_path):
    without_server = re.sub(r'<path class="area" data-series="(?:host|steps)-server"[^>]*/>', "", report)
    empty = re.sub(r'<path class="(?:area|line|band)"[^>]*/>|<g class="budget">.*?</g>', "", report)
    for name, page in (("without-server", without_server), ("empty", empty)):
        assert page != report
        path = tmp_path / f"{name}.html"
        path.write_text(page)
        png = screenshot(path, tmp_path / f"{name}.png")
        with pytest.raises(AssertionError, match="series not drawn"):
            check_run_chart(page, png, STEPS)


def test_ticks_are_round_values_with_units():
    ticks = byte_ticks(parse_size("96MiB"))
    assert [byte_label(t) for t in ticks] == ["0", "20 MiB", "40 MiB", "60 MiB", "80 MiB", "100 MiB"]
    assert [byte_label(t) for t in byte_ticks(parse_size("23.5GiB"))] == [
        "0",
        "5 GiB",
        "10 GiB",
        "15 GiB",
        "20 GiB",
        "25 GiB",
    ]
    assert byte_label(parse_size("1.5GiB")) == "1.5 GiB"
    assert [time_label(t, 6.9) for t in time_ticks(6.9)] == [f"0:0{i}" for i in range(7)]
    assert [time_label(t, 5400) for t in time_ticks(5400)][:3] == ["0:00", "0:15", "0:30"]


def test_each_size_axis_is_labelled_in_one_unit_chosen_from_its_top():
    def labels(top: float) -> list[str]:
        ticks = byte_ticks(top)
        return re.findall(
            r'text-anchor="end">([^<]+)</text>', y_axis(Scale(0, ticks[-1], 100, 0), ticks, 0, 10)
        )

    assert labels(1.4 * GIB) == ["0", "0.5 GiB", "1 GiB", "1.5 GiB"]  # not 500 MiB, 1000 MiB, 1.5 GiB
    assert labels(GIB) == ["0", "0.25 GiB", "0.5 GiB", "0.75 GiB", "1 GiB"]  # not 256 MiB … 1 GiB
    assert labels(96 * MIB) == ["0", "20 MiB", "40 MiB", "60 MiB", "80 MiB", "100 MiB"]
    top = 2 * MIB
    while top < 64 * GIB:
        ticks, shown = byte_ticks(top), labels(top)
        assert ticks[-1] >= top and len(ticks) <= 6, (top, shown)
        assert len({label.split()[1] for label in shown[1:]}) == 1, (top, shown)
        top *= 1.07


def _build_ledger(run_dir: Path, *, running: bool = False) -> int:
    """A build as the broker records it, with a 4 GiB budget: job a admitted at 3 GiB, its reservation
    shrunk to 1 GiB after its peak (t0 + 10 s), which made room for job b, admitted at 2.5 GiB at
    t0 + 12 s and shrunk to 1.5 GiB at t0 + 20 s. Returns b's attempt id."""
    ledger = Ledger(run_dir)
    t0 = time.time() - 60
    ledger.start_run("b1", "eyrie build", "cgroup", [], 4 * GIB, "build budget")
    ids = {}
    for job, limit, start in (("a.cu", 3 * GIB, 0), ("b.cu", 5 * GIB // 2, 12)):
        ids[job] = ledger.begin_attempt(
            run_id="b1",
            step=job,
            attempt=1,
            executor="cgroup",
            limit_bytes=limit,
            limit_reason=None,
            argv=["nvcc"],
            host_mem_available=8 * GIB,
            host_mem_total=16 * GIB,
            image=None,
            commit_id=None,
        )
        if not (running and job == "b.cu"):
            ledger.end_attempt(
                ids[job],
                verdict="succeeded",
                reason="exit 0",
                fields={
                    "started_at": t0 + start,
                    "ended_at": t0 + 30,
                    "peak_bytes": GIB,
                    "anon_peak_bytes": GIB,
                    "exit_code": 0,
                },
                timeline=[(float(s), GIB // 2, GIB // 2) for s in range(1, 31 - start)],
            )
    reservations = (
        ("a.cu", 3 * GIB, 0),
        ("a.cu", GIB, 10),
        ("b.cu", 5 * GIB // 2, 12),
        ("b.cu", 3 * GIB // 2, 20),
    )
    for job, reserved, _ in reservations:
        ledger.reserve(ids[job], reserved, None, "a change")
    ledger.close()
    db = sqlite3.connect(run_dir / LEDGER_NAME)
    for rowid, (_, _, at) in enumerate(reservations, start=1):
        db.execute("UPDATE reservations SET t = ? WHERE rowid = ?", (t0 + at, rowid))
    if running:
        db.execute("UPDATE attempts SET started_at = ? WHERE id = ?", (t0 + 12, ids["b.cu"]))
    else:
        db.execute("UPDATE runs SET ended_at = ?, state = 'succeeded'", (t0 + 30,))
    db.commit()
    db.close()
    return ids["b.cu"]


def _stack_top_and_budget(page: str) -> tuple[int, int]:
    """The steps panel's highest band edge and its budget line, in pixels from the top."""
    chart = page[page.index('<svg class="run-chart"') : page.index("</svg>")]
    bands = re.findall(r'<path class="band" data-step="[^"]+" d="([^"]+)"', chart)
    assert bands, "no band drawn"
    tops = [min(int(v) for v in re.findall(r"(?:,|V)(\d+)", d)) for d in bands]
    (budget,) = re.findall(r'<g class="budget"><line [^>]*y1="(\d+)"', chart[chart.index("Steps:") :])[:1]
    return min(tops), int(budget)


def test_a_build_s_bands_follow_each_job_s_reservation_and_never_cross_the_budget(tmp_path):
    _build_ledger(tmp_path)
    eyrie("report", "--run-dir", str(tmp_path), check=True)
    page = (tmp_path / "report.html").read_text()
    top, budget = _stack_top_and_budget(page)
    # At their admitted limits the two jobs would stack to 5.5 GiB, over the 4 GiB budget: an
    # overcommit that never happened. Drawn as reserved, the stack stays at or under the budget.
    assert top >= budget, f"the stack's top ({top}px) is above the budget line ({budget}px)"
    # The check fails on a chart that draws the limits instead of the reservations.
    ledger = sqlite3.connect(tmp_path / LEDGER_NAME)
    ledger.execute("DELETE FROM reservations")
    ledger.commit()
    ledger.close()
    eyrie("report", "--run-dir", str(tmp_path), check=True)
    top, budget = _stack_top_and_budget((tmp_path / "report.html").read_text())
    assert top < budget


def test_every_title_of_the_chart_fits_its_width_even_with_the_budget_far_above(tmp_path):
    _build_ledger(tmp_path)
    ledger = sqlite3.connect(tmp_path / LEDGER_NAME)
    ledger.execute("UPDATE runs SET budget_bytes = ?", (1023 * GIB,))  # far above the 3 GiB of bands
    ledger.commit()
    ledger.close()
    eyrie("report", "--run-dir", str(tmp_path), check=True)
    page = tmp_path / "report.html"
    assert "far above" in page.read_text()
    assert overflowing_text(page) == []
    # The check sees a title cut off at the chart's right edge.
    longer = page.with_name("longer.html")
    longer.write_text(page.read_text().replace("Attempts, coloured by verdict", "Attempts " * 40, 1))
    assert any(text.startswith("Attempts Attempts") for text in overflowing_text(longer))


def test_follow_counts_a_running_job_s_current_reservation(tmp_path):
    _build_ledger(tmp_path, running=True)
    ledger = Ledger(tmp_path, create=False)
    current = view(ledger, tmp_path)
    ledger.close()
    assert current.reserved_bytes == 3 * GIB // 2  # b's reservation now, not its admitted 2.5 GiB


def _budget_set_by_mem_available(run_dir: Path) -> None:
    """A run whose budget is the host's MemAvailable, which stays where it was at the start."""
    ledger = Ledger(run_dir)
    t0 = time.time() - 60
    ledger.start_run("r1", "p.yaml", "local", ["job"], 8 * GIB, "MemAvailable")
    job = ledger.begin_attempt(
        run_id="r1",
        step="job",
        attempt=1,
        executor="local",
        limit_bytes=GIB,
        limit_reason=None,
        argv=["job"],
        host_mem_available=8 * GIB,
        host_mem_total=16 * GIB,
        image=None,
        commit_id=None,
    )
    ledger.end_attempt(
        job,
        verdict="succeeded",
        reason="exit 0",
        fields={"started_at": t0, "ended_at": t0 + 30, "peak_bytes": GIB // 2, "exit_code": 0},
        timeline=[(float(s), GIB // 2, GIB // 2) for s in range(1, 31)],
    )
    for s in range(31):
        ledger.add_host_sample("r1", HostSample(t0 + s, 16 * GIB, 8 * GIB, 8 * GIB))
    ledger.close()
    db = sqlite3.connect(run_dir / LEDGER_NAME)
    db.execute("UPDATE runs SET started_at = ?, ended_at = ?, state = 'succeeded'", (t0, t0 + 30))
    db.commit()
    db.close()


def test_mem_available_equal_to_the_budget_still_shows_beside_its_line(tmp_path):
    _budget_set_by_mem_available(tmp_path)
    eyrie("report", "--run-dir", str(tmp_path), check=True)
    page = (tmp_path / "report.html").read_text()
    png = screenshot(tmp_path / "report.html", tmp_path / "report.png")
    drawn = chart_pixels(png, page, {"MemAvailable": AVAILABLE_COLOR, "budget": BUDGET_COLOR})
    plot_w = WIDTH - LEFT - RIGHT
    # Both lines run the whole width: MemAvailable 2 px high all along, the budget's dashes beside it.
    assert drawn["MemAvailable"] >= 1.8 * plot_w and drawn["budget"] >= plot_w, drawn
