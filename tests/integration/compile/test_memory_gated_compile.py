"""Real nvcc on small real CUDA translation units, under a tight cgroup limit.

The fixtures (``fixtures/big_*.cu``) each peak at about 0.9 GiB while cicc
instantiates templates. Four of them compiled at once need ~3.6 GiB; the limit
here is 2.5 GiB. ninja drives the compiles exactly as torch's cpp_extension
does (``nvcc = $PYTORCH_NVCC`` in the ninja file), once with the real nvcc and
once with the broker's stand-in.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.compile.broker import BuildBroker
from pipeline.compile.profile import JobKey, Profile, ProfileEntry
from pipeline.memory import step_parent
from pipeline.run.executor import Launch
from pipeline.run.ledger import Ledger
from pipeline.run.local import LocalExecutor
from pipeline.run.verdict import OOM_KILL_VERDICTS, decide

CUDA_HOME = Path("/usr/local/cuda-13.0")
NVCC = CUDA_HOME / "bin" / "nvcc"
FIXTURES = Path(__file__).parent / "fixtures"
GiB = 2**30
PKG = "flash-attn 2.8.3"
LIMIT = int(2.5 * GiB)
BIG = ["big_a.cu", "big_b.cu", "big_c.cu", "big_d.cu"]
NVCC_FLAGS = "-std=c++17 -gencode arch=compute_120,code=sm_120 --threads 1"

pytestmark = [
    pytest.mark.usefixtures("real_cgroups"),
    pytest.mark.skipif(not NVCC.is_file(), reason=f"needs nvcc at {NVCC}"),
    pytest.mark.skipif(shutil.which("ninja") is None, reason="needs ninja"),
    pytest.mark.timeout(900),
]


def write_ninja(build_dir: Path, nvcc_command: str, sources: list[str]) -> None:
    """A ninja file with torch cpp_extension's CUDA rule, compiling the fixture sources."""
    lines = [
        "ninja_required_version = 1.3",
        f"nvcc = {nvcc_command}",
        "rule cuda_compile",
        f"  command = $nvcc -c $in -o $out {NVCC_FLAGS}",
    ]
    lines += [f"build {build_dir / Path(s).stem}.o: cuda_compile {FIXTURES / s}" for s in sources]
    (build_dir / "build.ninja").write_text("\n".join(lines) + "\n")


def broker_for(tmp_path: Path, profile: Profile, budget: int = LIMIT) -> BuildBroker:
    return BuildBroker(
        nvcc=str(NVCC),
        nvcc_version="13.0",
        package=PKG,
        profile=profile,
        budget=budget,
        cpu_slots=4,
        run_dir=tmp_path / "run",
    )


def ninja(build_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        ["ninja", "-j", "4"],
        cwd=build_dir,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=800,
    )


def test_plain_parallel_compile_is_oom_killed_but_the_scheduler_is_not(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    write_ninja(plain, str(NVCC), BIG)
    attempt = LocalExecutor(parent=step_parent()).start(
        Launch(
            run_id="plain",
            step=f"ninja-{tmp_path.name}",
            attempt=1,
            argv=["ninja", "-j", "4"],
            cwd=plain,
            env={"PATH": f"{CUDA_HOME}/bin:/usr/bin:/bin"},
            limit_bytes=LIMIT,
            stdout_path=tmp_path / "plain.out",
            stderr_path=tmp_path / "plain.err",
        )
    )
    outcome = attempt.wait()
    # Killed by the kernel, or by the runner once the compiles thrash at the limit (run/monitor.py).
    verdict = decide(outcome, False, "no object files").verdict
    assert verdict in OOM_KILL_VERDICTS, "four 0.9 GiB compiles at once should not fit 2.5 GiB"
    assert outcome.exit_code != 0

    # Nothing measured: every job holds the conservative default (here the whole budget),
    # whatever the others measure as they finish, so they run one at a time.
    unmeasured = Profile(default_peak=LIMIT)
    rows = scheduled_build(tmp_path / "first", unmeasured)
    spans = sorted((r.started_at, r.ended_at) for r in rows)
    assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:], strict=False)), spans

    # The same files measured with another nvcc (12.9 here): predicted from that neighbour,
    # they run side by side, and each job's reservation is in the ledger with its basis.
    neighbour = Profile([replace(e, nvcc="12.9") for e in unmeasured.entries()], default_peak=LIMIT)
    rows = scheduled_build(tmp_path / "second", neighbour)
    spans = sorted((r.started_at, r.ended_at) for r in rows)
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False)), spans
    assert all("for nvcc 12.9" in r.limit_reason for r in rows)
    held = Ledger(tmp_path / "second", create=False).reservations()
    assert all(held[r.id][0]["reserved_bytes"] == r.limit_bytes < LIMIT for r in rows)
    assert all(held[r.id][0]["expected_bytes"] < held[r.id][0]["reserved_bytes"] for r in rows)


def scheduled_build(run_dir: Path, profile: Profile) -> list:
    """The four big fixtures through the broker under LIMIT: all compiled, no OOM kill, every attempt."""
    build = run_dir / "build"
    build.mkdir(parents=True)
    with BuildBroker(
        nvcc=str(NVCC),
        nvcc_version="13.0",
        package=PKG,
        profile=profile,
        budget=LIMIT,
        cpu_slots=4,
        run_dir=run_dir,
    ) as broker:
        write_ninja(build, broker.env()["PYTORCH_NVCC"], BIG)
        done = ninja(build, broker.env())
    report = broker.report()
    assert done.returncode == 0, done.stdout + done.stderr
    assert all((build / f"{Path(s).stem}.o").is_file() for s in BIG)
    assert report.oom_kills == 0 and report.peak_reserved <= LIMIT
    rows = Ledger(run_dir, create=False).attempts()
    assert sorted(r.step for r in rows) == sorted(BIG)
    assert {r.verdict for r in rows} == {"succeeded"}
    assert all(0 < r.anon_peak_bytes <= r.limit_bytes for r in rows)
    return rows


def test_a_job_predicted_too_low_is_oom_killed_once_and_rerun(tmp_path: Path) -> None:
    build = tmp_path / "build"
    build.mkdir()
    # A stale measurement: big_a.cu "needed" 0.55 GiB. Its limit (0.55 × 1.15) is too low.
    stale = ProfileEntry(
        "big_a.cu", ["120"], 1, "13.0", anon_peak_bytes=int(0.55 * GiB), wall_s=5, package=PKG
    )
    profile = Profile([stale], default_peak=LIMIT)
    with broker_for(tmp_path, profile) as broker:
        write_ninja(build, broker.env()["PYTORCH_NVCC"], ["big_a.cu", "small_a.cu"])
        done = ninja(build, broker.env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert (build / "big_a.o").is_file()

    rows = Ledger(tmp_path / "run", create=False).attempts("big_a.cu")
    assert [r.verdict for r in rows][0] in ("oom_killed", "child_oom_killed")
    assert rows[0].oom_kills >= 1 or "thrashing" in rows[0].reason
    assert [r.verdict for r in rows][1:] == ["succeeded"]
    assert rows[1].limit_bytes > rows[0].limit_bytes
    # The build learned the real figure for the rest of the build (and the next one).
    learned = profile.predict(JobKey("big_a.cu", ("120",), 1, "13.0", PKG))
    assert learned.peak_bytes > rows[0].limit_bytes


def test_a_budget_below_one_job_fails_the_build_with_the_numbers(tmp_path: Path) -> None:
    build = tmp_path / "build"
    build.mkdir()
    budget = 300 * 2**20
    with broker_for(tmp_path, Profile(default_peak=budget), budget=budget) as broker:
        write_ninja(build, broker.env()["PYTORCH_NVCC"], ["big_a.cu"])
        done = ninja(build, broker.env())
    assert done.returncode != 0
    assert "OOM-killed holding the whole budget of 0.29 GiB" in done.stdout + done.stderr
    assert not (build / "big_a.o").exists()


def test_without_cgroups_jobs_run_as_processes_with_peaks_from_proc(tmp_path: Path, monkeypatch) -> None:
    """Inside `docker build` no cgroup can be created: admission still works, peaks come from /proc."""
    import pipeline.compile.broker as broker_module
    from pipeline.memory import CgroupError

    def read_only_cgroups():
        raise CgroupError("cannot create cgroup: read-only file system")

    monkeypatch.setattr(broker_module, "step_parent", read_only_cgroups)
    build = tmp_path / "build"
    build.mkdir()
    with broker_for(tmp_path, Profile(default_peak=GiB)) as broker:
        assert broker.cgroup is None and "no cgroup can be created here" in broker.confinement
        write_ninja(build, broker.env()["PYTORCH_NVCC"], ["small_a.cu", "small_b.cu"])
        done = ninja(build, broker.env())
    assert done.returncode == 0, done.stdout + done.stderr
    rows = Ledger(tmp_path / "run", create=False).attempts()
    assert {r.executor for r in rows} == {"unconfined"} and {r.verdict for r in rows} == {"succeeded"}
    assert all(r.anon_peak_bytes > 100 * 2**20 for r in rows)  # cicc's front end at least
