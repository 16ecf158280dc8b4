from __future__ import annotations

import json
import math
import sys
import threading
from pathlib import Path

from pipeline.compile.flash_attn import load_profile
from pipeline.compile.profile import (
    SHIPPED_PROFILES,
    JobKey,
    Profile,
    ProfileEntry,
    parse_nvcc_argv,
    shape_of,
)

GiB = 2**30
PKG = "flash-attn 2.8.3"


def entry(
    source: str,
    peak: float,
    nvcc: str = "13.0",
    archs=("120",),
    threads: int = 1,
    package: str = PKG,
    shape=(0.2, 1.0, 0.3),
) -> ProfileEntry:
    return ProfileEntry(
        source, list(archs), threads, nvcc, int(peak * GiB), 100.0, package, shape=list(shape)
    )


def test_parse_nvcc_argv_as_torch_writes_it() -> None:
    argv = [
        "-MD",
        "-MF",
        "x.o.d",
        "-I/inc",
        "-c",
        "/src/flash_bwd_hdim128_bf16_sm80.cu",
        "-o",
        "x.o",
        "-O3",
        "-gencode",
        "arch=compute_100,code=sm_100",
        "-gencode",
        "arch=compute_120,code=sm_120",
        "--threads",
        "4",
    ]
    assert parse_nvcc_argv(argv) == ("/src/flash_bwd_hdim128_bf16_sm80.cu", ("100", "120"), 4)
    assert parse_nvcc_argv(["-c", "a.cu", "-arch=sm_90a"]) == ("a.cu", ("90a",), 1)


def test_exact_measurement_with_margin() -> None:
    p = Profile(
        [ProfileEntry("a.cu", ["120"], 1, "13.0", anon_peak_bytes=6 * GiB, wall_s=120, package=PKG)],
        default_peak=8 * GiB,
        margin=1.15,
    )
    pred = p.predict(JobKey("a.cu", ("120",), 1, "13.0", PKG))
    assert pred.peak_bytes == math.ceil(6 * GiB * 1.15)
    assert pred.wall_s == 120


def test_other_archs_and_threads_scale_by_archs_in_flight() -> None:
    p = Profile(
        [ProfileEntry("a.cu", ["120"], 1, "13.0", anon_peak_bytes=6 * GiB, wall_s=120, package=PKG)],
        default_peak=8 * GiB,
        margin=1.0,
    )
    two_parallel = p.predict(JobKey("a.cu", ("100", "120"), 4, "13.0", PKG))
    assert two_parallel.peak_bytes == 12 * GiB and two_parallel.wall_s == 120
    two_serial = p.predict(JobKey("a.cu", ("100", "120"), 1, "13.0", PKG))
    assert two_serial.peak_bytes == 6 * GiB and two_serial.wall_s == 240


def test_a_file_never_measured_keeps_the_default_and_only_rises_from_it() -> None:
    p = Profile(default_peak=8 * GiB, margin=1.0)
    key = JobKey("new.cu", ("120",), 1, "13.0", PKG)
    assert p.predict(key).peak_bytes == 8 * GiB and p.predict(key).expected_bytes is None
    p.observe(JobKey("small.cu", ("120",), 1, "13.0", PKG), 3 * GiB, 60.0)
    assert p.predict(key).peak_bytes == 8 * GiB  # a small file's peak says nothing about a big one
    p.observe(JobKey("huge.cu", ("120",), 1, "13.0", PKG), 9 * GiB, 60.0)
    assert p.predict(key).peak_bytes == 9 * GiB  # but a larger one than the default raises it
    assert p.predict(JobKey("new.cu", ("90",), 1, "13.0", PKG)).peak_bytes == 8 * GiB  # other config


def test_the_issue_reproduction_an_unmeasured_toolchain_is_not_predicted_below_its_neighbour() -> None:
    """nvcc 13.1 unmeasured: after a small file finished, big ones were admitted at 4.21 GiB, OOM-killed.
    (13.1's profile ships now: the case is replayed with the nvcc 13.0 profile alone.)"""
    shipped = Profile.load([SHIPPED_PROFILES / "flash-attn-2.8.3-nvcc13.0.json"], default_peak=1, margin=1.0)
    p = Profile.load(
        [SHIPPED_PROFILES / "flash-attn-2.8.3-nvcc13.0.json"],
        default_peak=load_profile(("120",), 1).default_peak,
        margin=1.0,
    )

    def key(name: str, nvcc: str = "13.1") -> JobKey:
        return JobKey(name, ("120",), 1, nvcc, PKG)

    small, big = "flash_fwd_hdim64_fp16_sm80.cu", "flash_bwd_hdim256_bf16_sm80.cu"
    neighbour = shipped.predict(key(big, "13.0")).peak_bytes
    assert p.predict(key(big)).peak_bytes >= neighbour
    p.observe(key(small), int(3.66 * GiB), 117)
    ratio = 3.66 * GiB / shipped.predict(key(small, "13.0")).peak_bytes
    after = p.predict(key(big))
    assert after.peak_bytes >= neighbour * max(1.0, ratio) - 1
    assert after.peak_bytes > 6 * GiB and "nvcc 13.0" in after.basis


def test_finished_jobs_scale_derived_estimates_up_never_down() -> None:
    p = Profile([entry("a.cu", 4.0), entry("b.cu", 6.0)], default_peak=8 * GiB, margin=1.0)
    a, b = (JobKey(n, ("120",), 1, "13.1", PKG) for n in ("a.cu", "b.cu"))
    assert p.predict(b).peak_bytes == 6 * GiB
    p.observe(a, int(4.4 * GiB), 10)  # 13.1 needs 10% more than 13.0 here
    assert abs(p.predict(b).peak_bytes - 6 * GiB * 1.1) <= 2
    assert "× 1.10" in p.predict(b).basis
    q = Profile([entry("a.cu", 4.0), entry("b.cu", 6.0)], default_peak=8 * GiB, margin=1.0)
    q.observe(a, 2 * GiB, 10)  # less than the neighbour: the neighbour's figure stands
    assert q.predict(b).peak_bytes == 6 * GiB


def test_the_nearest_toolchain_of_the_same_package_version_is_the_neighbour() -> None:
    measured = [
        entry("a.cu", 4.0, nvcc="12.8"),
        entry("a.cu", 5.0, nvcc="13.0"),
        entry("a.cu", 9.0, package="flash-attn 2.7.4"),
    ]
    p = Profile(measured, default_peak=8 * GiB, margin=1.0)
    assert p.predict(JobKey("a.cu", ("120",), 1, "13.1", PKG)).peak_bytes == 5 * GiB
    assert p.predict(JobKey("a.cu", ("120",), 1, "12.9", PKG)).peak_bytes == 4 * GiB
    # Another version of the package is another file: the default, not its figure.
    assert p.predict(JobKey("a.cu", ("120",), 1, "13.0", "flash-attn 2.8.4")).peak_bytes == 8 * GiB


def test_a_derived_estimate_keeps_the_shape_once_per_wave_of_archs() -> None:
    p = Profile([entry("a.cu", 4.0, shape=(0.2, 1.0, 0.3))], default_peak=8 * GiB, margin=1.0)
    serial = p.predict(JobKey("a.cu", ("100", "120"), 1, "13.0", PKG))
    assert serial.shape == (0.2, 1.0, 0.3, 0.2, 1.0, 0.3) and serial.peak_bytes == 4 * GiB
    parallel = p.predict(JobKey("a.cu", ("100", "120"), 2, "13.0", PKG))
    assert parallel.shape == (0.2, 1.0, 0.3) and parallel.peak_bytes == 8 * GiB


def test_repeated_measurements_keep_the_larger_peak() -> None:
    p = Profile(default_peak=GiB, margin=1.0)
    key = JobKey("a.cu", ("120",), 1, "13.0", PKG)
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
    p.observe(JobKey("a.cu", ("120",), 1, "13.0", PKG), 5 * GiB, 10, [(1.0, 0, 5 * GiB)])
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
        unmeasured = JobKey("never_measured.cu", ("120",), 1, "13.0", PKG)
        while not finished.is_set():
            try:
                profile.predict(unmeasured)
            except RuntimeError as exc:  # "dictionary changed size during iteration"
                errors.append(exc)
                return

    def observe() -> None:
        for i in range(10_000):
            profile.observe(JobKey(f"f{i}.cu", ("120",), 1, "13.0", PKG), GiB, 1.0)
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
