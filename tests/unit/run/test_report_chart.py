"""The run chart of `eyrie report`, drawn by a real browser: every series is there, with its axes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from eyrie_testing import chart_pixels, check_run_chart, eyrie, screenshot
from pipeline.memory import parse_size
from pipeline.report.chart import (
    CRASH_COLOR,
    FAILED_COLOR,
    OOM_COLOR,
    VERDICT_COLORS,
    byte_label,
    byte_ticks,
    time_label,
    time_ticks,
)

STEPS = ["server", "prep-a", "prep-b", "grows"]


@pytest.fixture(scope="module")
def report(neighbours_run: Path) -> str:
    eyrie("report", "--run-dir", str(neighbours_run), check=True)
    return (neighbours_run / "report.html").read_text()


def test_the_run_chart_draws_the_host_every_step_the_budget_and_each_death(report, neighbours_run, tmp_path):
    png = screenshot(neighbours_run / "report.html", tmp_path / "report.png")
    check_run_chart(report, png, STEPS)
    marks = chart_pixels(png, report, {
        "OOM kill": OOM_COLOR, "crash": CRASH_COLOR, "succeeded bar": VERDICT_COLORS["succeeded"],
        "completed_then_crashed bar": VERDICT_COLORS["completed_then_crashed"], "failed bars": FAILED_COLOR,
    })  # fmt: skip
    assert all(n >= 100 for n in marks.values()), marks
    # Each death is marked at its step and its kind; each attempt has its bar.
    events = set(re.findall(r'<g class="event" data-what="([^"]+)" data-step="([^"]+)"', report))
    assert events == {("OOM kill", "grows"), ("crash", "prep-a"), ("crash", "prep-b")}
    bars = re.findall(r'<g class="attempt" data-step="([^"]+)" data-verdict="([^"]+)"', report)
    assert sorted(bars) == sorted([("server", "succeeded"), ("prep-a", "completed_then_crashed"),
                                   ("prep-b", "crashed"), ("grows", "oom_killed")])  # fmt: skip
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
    assert [byte_label(t) for t in byte_ticks(parse_size("23.5GiB"))] == ["0", "5 GiB", "10 GiB", "15 GiB",
                                                                          "20 GiB", "25 GiB"]  # fmt: skip
    assert byte_label(parse_size("1.5GiB")) == "1.5 GiB"
    assert [time_label(t, 6.9) for t in time_ticks(6.9)] == [f"0:0{i}" for i in range(7)]
    assert [time_label(t, 5400) for t in time_ticks(5400)][:3] == ["0:00", "0:15", "0:30"]
