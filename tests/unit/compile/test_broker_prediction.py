"""What the broker gives a job from its prediction: reservation, basis, and whether it may shrink."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.compile.broker import BuildBroker
from pipeline.compile.profile import JobKey, Profile, ProfileEntry
from pipeline.compile.scheduler import Job

GiB = 2**30
PKG = "flash-attn 2.8.3"


@pytest.fixture
def predict(tmp_path: Path):
    """A job as the broker of a build with this budget predicts it (the broker is never started)."""
    made = []

    def run(name: str, budget: int) -> Job:
        measured = ProfileEntry("a.cu", ["120"], 1, "13.0", 6 * GiB, 100.0, PKG, shape=[0.5, 1.0, 0.2])
        broker = BuildBroker(
            nvcc="nvcc",
            nvcc_version="13.0",
            package=PKG,
            budget=budget,
            cpu_slots=2,
            profile=Profile([measured], default_peak=8 * GiB),
            run_dir=tmp_path,
        )
        made.append(broker)
        job = Job(name, 0, key=JobKey(name, ("120",), 1, "13.0", PKG))
        broker._predict(job)
        return job

    yield run
    for broker in made:
        broker.ledger.close()
        os.rmdir(broker._socket_dir)


def test_a_prediction_cut_to_the_budget_says_so_with_the_margin_left(predict) -> None:
    cut = predict("a.cu", budget=int(6.3 * GiB))
    assert cut.basis.endswith("; cut to the budget 6.30 GiB, 1.05× the expected peak")
    whole = predict("a.cu", budget=16 * GiB)
    assert "cut" not in whole.basis and whole.expected == 6 * GiB and whole.watch is not None


def test_a_default_guess_never_shrinks(predict) -> None:
    unknown = predict("never_measured.cu", budget=16 * GiB)
    assert unknown.reservation == 8 * GiB and unknown.expected is None and unknown.watch is None
    assert unknown.wall_s is None  # ordered before every measured job
