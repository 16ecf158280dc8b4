from __future__ import annotations

import pytest

from pipeline.compile.scheduler import RETRY_GROWTH, AdmissionScheduler, BudgetTooSmall, Job

GiB = 2**30


def names(jobs: list[Job]) -> list[str]:
    return [j.name for j in jobs]


def test_admits_while_predicted_peaks_fit_the_budget() -> None:
    s = AdmissionScheduler(budget=10 * GiB, cpu_slots=8)
    assert names(s.submit(Job("a", 4 * GiB))) == ["a"]
    assert names(s.submit(Job("b", 4 * GiB))) == ["b"]
    assert s.submit(Job("c", 4 * GiB)) == []  # 12 GiB would not fit
    assert s.reserved == 8 * GiB


def test_cpu_slots_bound_admission_too() -> None:
    s = AdmissionScheduler(budget=100 * GiB, cpu_slots=3)
    s.submit(Job("a", GiB, slots=2))
    assert s.submit(Job("b", GiB, slots=2)) == []
    assert names(s.submit(Job("c", GiB, slots=1))) == ["c"]


def test_largest_waiting_job_first_then_small_ones_fill_the_gap() -> None:
    s = AdmissionScheduler(budget=10 * GiB, cpu_slots=8)
    first = s.submit(Job("running", 6 * GiB))[0]
    for name, size in [("small1", 2 * GiB), ("big", 7 * GiB), ("small2", 2 * GiB)]:
        s.submit(Job(name, size))
    assert names(s.running) == ["running", "small1", "small2"]
    assert names(s.release(first)) == []  # big (7) does not fit next to 4 GiB of small jobs
    assert names(s.release(s.running[0])) == ["big"]


def test_release_repredicts_waiting_first_attempts() -> None:
    s = AdmissionScheduler(budget=10 * GiB, cpu_slots=8)
    first = s.submit(Job("a", 10 * GiB))[0]
    s.submit(Job("b", 10 * GiB))
    s.submit(Job("c", 10 * GiB))
    assert names(s.release(first, repredict=lambda job: 3 * GiB)) == ["b", "c"]


def test_a_job_bigger_than_the_budget_runs_alone_on_the_whole_budget() -> None:
    s = AdmissionScheduler(budget=4 * GiB, cpu_slots=8)
    job = s.submit(Job("huge", 9 * GiB))[0]
    assert job.reservation == 4 * GiB


def test_oom_requeues_with_the_observed_peak_grown() -> None:
    s = AdmissionScheduler(budget=16 * GiB, cpu_slots=8)
    job = s.submit(Job("a", 2 * GiB))[0]
    other = s.submit(Job("b", 13 * GiB))[0]
    assert s.requeue_after_oom(job, observed_peak=2 * GiB) == []  # 4 GiB waits for b
    assert job.reservation == int(2 * GiB * RETRY_GROWTH) and job.attempt == 2
    assert names(s.release(other, repredict=lambda j: GiB)) == ["a"]
    assert job.reservation == 4 * GiB  # a retry keeps its grown reservation


def test_oom_while_holding_the_whole_budget_is_refused_with_numbers() -> None:
    s = AdmissionScheduler(budget=4 * GiB, cpu_slots=8)
    job = s.submit(Job("huge.cu", 9 * GiB))[0]
    with pytest.raises(BudgetTooSmall, match=r"huge.cu was OOM-killed holding the whole budget of 4.00 GiB"):
        s.requeue_after_oom(job, observed_peak=4 * GiB)


def test_abort_wakes_every_waiting_job() -> None:
    s = AdmissionScheduler(budget=4 * GiB, cpu_slots=8)
    s.submit(Job("a", 4 * GiB))
    waiting = Job("b", 4 * GiB)
    s.submit(waiting)
    assert not waiting.admitted.is_set()
    s.abort()
    assert waiting.admitted.is_set() and not s.waiting
