"""A job's reservation shrinks once its peak has passed, on real processes in real cgroups.

The compiler here is a stand-in (``STAND_IN_COMPILER``, a test fake named as
such): real nvcc jobs of the fixtures peak at their very end, so they have no
tail to give back. The stand-in allocates and touches the memory its source
file names, phase by phase, then writes its object file; the broker, the
scheduler, the cgroups and the ledger are the real ones.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.compile.broker import BuildBroker, BuildReport
from pipeline.compile.profile import Profile, ProfileEntry
from pipeline.run.ledger import Ledger

MiB = 2**20
PKG = "stand-in 1.0"
FLAGS = "-gencode arch=compute_120,code=sm_120 --threads 1"
STAND_IN_COMPILER = """
import sys, time
source, out = sys.argv[sys.argv.index("-c") + 1], sys.argv[sys.argv.index("-o") + 1]
for phase in open(source).read().split(";"):
    mib, seconds = (float(x) for x in phase.split())
    held = bytearray(int(mib * 2**20))
    for i in range(0, len(held), 4096):  # touch every page: anonymous memory in use
        held[i] = 1
    time.sleep(seconds)
    del held
open(out, "w").write("object")
"""
# 600 MiB for 4 s, then 40 MiB for 8 s: measured shape of a peak, then a long low tail.
PEAK_THEN_TAIL = "600 4;40 8"
SHAPE = [0.6, 1.0, 1.0, 1.0] + [0.15] * 8

pytestmark = [
    pytest.mark.usefixtures("real_cgroups"),
    pytest.mark.skipif(shutil.which("ninja") is None, reason="needs ninja"),
    pytest.mark.timeout(300),
]


@pytest.fixture
def watch_errors(monkeypatch: pytest.MonkeyPatch) -> list:
    """Exceptions that end a thread (the broker's shape watch among them), which pytest would only warn of."""
    errors: list = []
    monkeypatch.setattr("threading.excepthook", errors.append)
    return errors


def build(tmp_path: Path, sources: dict[str, str], budget: int) -> tuple[list, dict, BuildReport]:
    compiler = tmp_path / "stand_in_compiler"
    compiler.write_text(f"#!{sys.executable}\n{STAND_IN_COMPILER}")
    compiler.chmod(0o755)
    src = tmp_path / "src"
    src.mkdir()
    for name, plan in sources.items():
        (src / name).write_text(plan)
    measured = [ProfileEntry(name, ["120"], 1, "13.0", 600 * MiB, 12.0, PKG, shape=SHAPE) for name in sources]
    profile = Profile(measured, default_peak=budget)
    with BuildBroker(
        nvcc=str(compiler),
        nvcc_version="13.0",
        package=PKG,
        profile=profile,
        budget=budget,
        cpu_slots=2,
        run_dir=tmp_path / "run",
    ) as broker:
        lines = ["rule cc", f"  command = {broker.env()['PYTORCH_NVCC']} -c $in -o $out {FLAGS}"]
        lines += [f"build {tmp_path / name}.o: cc {src / name}" for name in sources]
        (tmp_path / "build.ninja").write_text("\n".join(lines) + "\n")
        env = {**os.environ, **broker.env()}
        done = subprocess.run(
            ["ninja", "-j", str(len(sources))],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    assert done.returncode == 0, done.stdout + done.stderr
    report = broker.report()
    assert report.oom_kills == 0
    ledger = Ledger(tmp_path / "run", create=False)
    try:
        return ledger.attempts(), ledger.reservations(), report
    finally:
        ledger.close()


def test_a_job_past_its_peak_gives_back_memory_and_the_next_one_starts_beside_it(
    tmp_path: Path, watch_errors: list
) -> None:
    # Each reserves 600 MiB × 1.15 = 690 MiB: two do not fit 1 GiB until one has passed its peak.
    rows, held, report = build(tmp_path, {"a.cu": PEAK_THEN_TAIL, "b.cu": PEAK_THEN_TAIL}, budget=1024 * MiB)
    assert watch_errors == []
    assert [j.reservations for j in report.jobs] == [[690 * MiB]] * 2  # as admitted, before the shrink
    first, second = sorted(rows, key=lambda r: r.started_at)
    assert second.started_at < first.ended_at, "the second job started while the first ran its tail"
    shrunk = held[first.id]
    assert [r["reserved_bytes"] for r in shrunk][0] == first.limit_bytes == 690 * MiB
    assert len(shrunk) == 2 and shrunk[1]["reserved_bytes"] < 120 * MiB  # 0.15 × 600 MiB × 1.15
    assert "peak passed" in shrunk[1]["reason"]
    assert shrunk[0]["t"] < shrunk[1]["t"] <= second.started_at + 1


def test_a_job_running_above_its_shape_keeps_its_reservation(tmp_path: Path, watch_errors: list) -> None:
    # Past its peak it still holds 400 MiB, far above the 90 MiB its shape says is left.
    rows, held, _ = build(tmp_path, {"a.cu": "600 4;400 6"}, budget=1024 * MiB)
    assert watch_errors == []
    assert [r["reserved_bytes"] for r in held[rows[0].id]] == [690 * MiB]
