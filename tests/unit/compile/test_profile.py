from __future__ import annotations

import json
import math
import sys
import threading
from pathlib import Path

from pipeline.compile.profile import (
    SHIPPED_PROFILES,
    JobKey,
    Profile,
    ProfileEntry,
    parse_nvcc_argv,
    shape_of,
)

GiB = 2**30


def test_parse_nvcc_argv_as_torch_writes_it() -> None:
    argv = ["-MD", "-MF", "x.o.d", "-I/inc", "-c", "/src/flash_bwd_hdim128_bf16_sm80.cu", "-o", "x.o",
            "-O3", "-gencode", "arch=compute_100,code=sm_100", "-gencode", "arch=compute_120,code=sm_120",
            "--threads", "4"]  # fmt: skip
    assert parse_nvcc_argv(argv) == ("/src/flash_bwd_hdim128_bf16_sm80.cu", ("100", "120"), 4)
    assert parse_nvcc_argv(["-c", "a.cu", "-arch=sm_90a"]) == ("a.cu", ("90a",), 1)


def test_exact_measurement_with_margin() -> None:
    p = Profile([ProfileEntry("a.cu", ["120"], 1, "13.0", anon_peak_bytes=6 * GiB, wall_s=120)],
                default_peak=8 * GiB, margin=1.15)  # fmt: skip
    pred = p.predict(JobKey("a.cu", ("120",), 1, "13.0"))
    assert pred.peak_bytes == math.ceil(6 * GiB * 1.15)
    assert pred.wall_s == 120


def test_other_archs_and_threads_scale_by_archs_in_flight() -> None:
    p = Profile([ProfileEntry("a.cu", ["120"], 1, "13.0", anon_peak_bytes=6 * GiB, wall_s=120)],
                default_peak=8 * GiB, margin=1.0)  # fmt: skip
    two_parallel = p.predict(JobKey("a.cu", ("100", "120"), 4, "13.0"))
    assert two_parallel.peak_bytes == 12 * GiB and two_parallel.wall_s == 120
    two_serial = p.predict(JobKey("a.cu", ("100", "120"), 1, "13.0"))
    assert two_serial.peak_bytes == 6 * GiB and two_serial.wall_s == 240


def test_unknown_files_use_the_default_until_a_job_of_the_build_finishes() -> None:
    p = Profile(default_peak=8 * GiB, margin=1.0)
    key = JobKey("new.cu", ("120",), 1, "13.0")
    assert p.predict(key).peak_bytes == 8 * GiB
    p.observe(JobKey("other.cu", ("120",), 1, "13.0"), 3 * GiB, 60.0)
    assert p.predict(key).peak_bytes == 3 * GiB
    assert p.predict(JobKey("new.cu", ("90",), 1, "13.0")).peak_bytes == 8 * GiB  # other config


def test_repeated_measurements_keep_the_larger_peak() -> None:
    p = Profile(default_peak=GiB, margin=1.0)
    key = JobKey("a.cu", ("120",), 1, "13.0")
    p.observe(key, 5 * GiB, 10)
    p.observe(key, 4 * GiB, 10)
    assert p.predict(key).peak_bytes == 5 * GiB
    assert p.entries()[0].samples == 2


def test_shape_reduces_a_timeline_to_fractions_of_its_peak() -> None:
    timeline = [(t, 0, a) for t, a in [(1, 100), (2, 400), (3, 200), (4, 50)]]
    shape = shape_of(timeline, points=4)
    assert shape == [0.25, 1.0, 0.5, 0.125]


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    p = Profile(default_peak=GiB)
    p.observe(JobKey("a.cu", ("120",), 1, "13.0"), 5 * GiB, 10, [(1.0, 0, 5 * GiB)])
    p.save(tmp_path / "p.json", note="test")
    again = Profile.load([tmp_path / "p.json"], default_peak=GiB)
    assert again.entries()[0].anon_peak_bytes == 5 * GiB


def test_shipped_profiles_are_valid_measurements() -> None:
    files = sorted(SHIPPED_PROFILES.glob("*.json"))
    assert files, "the measured flash-attn profiles ship with the package"
    for file in files:
        data = json.loads(file.read_text())
        assert data["note"]
        for raw in data["entries"]:
            entry = ProfileEntry(**raw)
            assert entry.anon_peak_bytes > 100 * 2**20 and entry.wall_s > 0


def test_predictions_while_other_threads_record_measurements() -> None:
    """The broker predicts in one handler thread while others record finished jobs."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, mid-iteration included
    profile = Profile(default_peak=8 * GiB)
    finished, errors = threading.Event(), []

    def predict() -> None:
        unmeasured = JobKey("never_measured.cu", ("120",), 1, "13.0")
        while not finished.is_set():
            try:
                profile.predict(unmeasured)
            except RuntimeError as exc:  # "dictionary changed size during iteration"
                errors.append(exc)
                return

    def observe() -> None:
        for i in range(10_000):
            profile.observe(JobKey(f"f{i}.cu", ("120",), 1, "13.0"), GiB, 1.0)
        finished.set()

    threads = [threading.Thread(target=predict) for _ in range(3)] + [threading.Thread(target=observe)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        sys.setswitchinterval(interval)
    assert errors == [] and len(profile) == 10_000
