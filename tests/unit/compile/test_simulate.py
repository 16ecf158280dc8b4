from __future__ import annotations

import importlib.util
import sys

from benchmarks.compile_simulate import SimJob, simulate_fixed, simulate_scheduler
from eyrie_testing import REPO
from pipeline.compile.profile import SHIPPED_PROFILES, Profile

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


def test_shrinking_reservations_after_the_peak_packs_more_without_oom() -> None:
    spiky = [SimJob(f"j{i}", 10 * GB, 100.0, shape=(0.3, 1.0, 0.2, 0.2, 0.2, 0.2)) for i in range(6)]
    held = simulate_scheduler(spiky, budget=24 * GB, cores=8, memory=24 * GB, shrink=False)
    shrunk = simulate_scheduler(spiky, budget=24 * GB, cores=8, memory=24 * GB)
    assert held.oom_at is None and shrunk.oom_at is None
    assert held.max_parallel == 2  # 11.5 GB each with the margin: two fit 24 GB
    assert shrunk.makespan < 0.85 * held.makespan and shrunk.max_parallel > 2


def _incident_replay():
    """benchmarks/build_simulate.py, the benchmark whose table the README shows."""
    spec = importlib.util.spec_from_file_location("build_simulate", REPO / "benchmarks" / "build_simulate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_incident_replay_beats_the_best_fixed_max_jobs_under_every_model() -> None:
    bench = _incident_replay()
    profile = Profile.load([SHIPPED_PROFILES], default_peak=1)
    entries = [e for e in profile.entries() if e.archs == ["120"] and e.threads == 1 and e.nvcc == "13.0"]
    fitted = bench.fitted_factors(entries)
    for factor in (2.0, 4.0, fitted[len(fitted) // 2]):
        replay = bench.replay(factor, entries)
        oracle = replay.fixed[replay.best].makespan
        assert replay.scheduler.oom_at is None and replay.scheduler.peak_memory <= bench.MEMORY
        assert replay.scheduler.makespan <= oracle, (factor, replay.scheduler.makespan, oracle)
        assert replay.held.makespan > oracle  # holding every reservation to the end did not
