from __future__ import annotations

import math

import pytest

from pipeline.compile.scheduler import (
    RETRY_GROWTH,
    SETTLED_READINGS,
    AdmissionScheduler,
    BudgetTooSmall,
    Job,
    ShapeWatch,
)

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


def test_heaviest_memory_time_first_and_a_job_never_measured_before_any() -> None:
    s = AdmissionScheduler(budget=10 * GiB, cpu_slots=8)
    blocker = s.submit(Job("blocker", 10 * GiB))[0]
    s.submit(Job("big_short", 6 * GiB, wall_s=10))
    s.submit(Job("small_long", 4 * GiB, wall_s=100))
    s.submit(Job("unmeasured", 5 * GiB))
    assert names(s.release(blocker)) == ["unmeasured", "small_long"]  # 5 + 4 fit; 6 waits


def test_shrinking_a_running_job_admits_waiting_ones_into_what_it_gave_back() -> None:
    s = AdmissionScheduler(budget=10 * GiB, cpu_slots=8)
    first = s.submit(Job("a", 7 * GiB))[0]
    s.submit(Job("b", 6 * GiB))
    assert names(s.shrink(first, 3 * GiB)) == ["b"]
    assert s.reserved == 9 * GiB
    assert s.shrink(first, 5 * GiB) == [] and first.reservation == 3 * GiB  # never grows back this way


def test_shape_watch_releases_only_after_the_peak_and_within_the_shape() -> None:
    watch = ShapeWatch(peak=10 * GiB, shape=[0.2, 0.6, 1.0, 0.3, 0.2], margin=1.0)
    assert watch.tail == 0.3
    assert watch.rest(2 * GiB) is None  # ramping up: the peak is ahead
    assert watch.rest(6 * GiB) is None
    assert watch.rest(9 * GiB) is None  # at the peak
    assert watch.rest(5 * GiB) is None  # past it, but above what the shape says is left
    assert watch.rest(2 * GiB) is None and watch.rest(2 * GiB) is None  # within it: settling
    assert watch.rest(2 * GiB) == 3 * GiB


def test_shape_watch_waits_for_every_hump_of_archs_compiled_one_after_the_other() -> None:
    watch = ShapeWatch(peak=10 * GiB, shape=[0.2, 1.0, 0.2, 0.9, 0.25], margin=1.15)
    assert [watch.rest(int(f * 10 * GiB)) for f in (0.2, 1.0, 0.2)] == [None, None, None]
    assert watch.rest(int(0.9 * 10 * GiB)) is None
    assert [watch.rest(2 * GiB) for _ in range(SETTLED_READINGS)][-1] == math.ceil(0.25 * 10 * GiB * 1.15)


def test_a_dip_below_the_tail_for_a_moment_is_not_a_settled_tail() -> None:
    watch = ShapeWatch(peak=10 * GiB, shape=[0.2, 1.0, 0.3], margin=1.0)
    readings = [9, 1, 6, 6, 2, 2, 2]  # GiB: peak, a one-reading dip, back above its shape, then settled
    assert [watch.rest(r * GiB) for r in readings] == [None] * 6 + [3 * GiB]


def test_a_job_whose_memory_never_reaches_its_predicted_peak_keeps_its_reservation() -> None:
    watch = ShapeWatch(peak=10 * GiB, shape=[0.2, 1.0, 0.3], margin=1.0)
    assert all(watch.rest(int(f * 10 * GiB)) is None for f in (0.2, 0.5, 0.7, 0.2, 0.1))


def test_an_oom_retry_holds_its_grown_reservation_to_the_end() -> None:
    s = AdmissionScheduler(budget=16 * GiB, cpu_slots=8)
    job = s.submit(Job("a", 2 * GiB, watch=ShapeWatch(2 * GiB, [0.5, 1.0, 0.2], 1.15), expected=2 * GiB))[0]
    s.requeue_after_oom(job, observed_peak=2 * GiB)
    assert job.watch is None and job.expected is None and job.attempt == 2
