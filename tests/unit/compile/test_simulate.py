from __future__ import annotations

from pipeline.compile.simulate import SimJob, simulate_fixed, simulate_scheduler

GB = 10**9


def jobs(n: int, peak: int, duration: float = 100.0) -> list[SimJob]:
    return [SimJob(f"j{i}", peak, duration) for i in range(n)]


def test_fixed_max_jobs_runs_in_waves_and_ooms_past_the_memory() -> None:
    ok = simulate_fixed(jobs(8, 10 * GB), 4, cores=8, memory=40 * GB)
    assert ok.makespan == 200.0 and ok.oom_at is None and ok.max_parallel == 4
    oom = simulate_fixed(jobs(8, 10 * GB), 5, cores=8, memory=40 * GB)
    assert oom.makespan is None and oom.oom_at == 1.0 and oom.done_before_oom == 0


def test_cpu_oversubscription_slows_every_job() -> None:
    result = simulate_fixed(jobs(4, GB), 4, cores=2, memory=100 * GB)
    assert result.makespan == 200.0


def test_memory_shape_lets_jobs_overlap_their_low_phases() -> None:
    spiky = [SimJob(f"j{i}", 10 * GB, 100.0, shape=(1.0, 0.1, 0.1, 0.1)) for i in range(2)]
    assert simulate_fixed(spiky, 2, cores=8, memory=15 * GB).oom_at is not None  # peaks together
    assert simulate_fixed(spiky, 1, cores=8, memory=15 * GB).makespan == 200.0


def test_scheduler_packs_by_predicted_peak_without_oom() -> None:
    mixed = jobs(4, 10 * GB) + [SimJob(f"s{i}", 2 * GB, 100.0) for i in range(10)]
    result = simulate_scheduler(mixed, budget=40 * GB, cores=8, memory=40 * GB)
    assert result.oom_at is None and result.makespan is not None
    assert result.peak_memory <= 40 * GB
    naive = simulate_fixed(mixed, 8, cores=8, memory=40 * GB)
    assert naive.oom_at is not None  # eight at once: 4 × 10 + 4 × 2 GB
