"""Benchmark 2: the flash-attn incident replayed at its scale, from measured profiles.

The incident: 128 cores, 432 GB, flash-attn 2.8.3 for archs 100;120 with
nvcc --threads 4, OOM-killed at MAX_JOBS 128, 64, 48, 32; passed at 20 in ~10 min.

Inputs are the per-file profiles measured here (nvcc 13.0, sm_120 alone,
--threads 1; ``pipeline/compile/profiles/``): anonymous peak, wall time and the
memory shape over time. A file not measured takes the measurement of the same
kind (fwd / fwd_split / bwd) with the nearest head dimension. Scaling to the
incident's jobs (two archs, --threads 4), three models, all reported:

- ``archs``: nvcc's --threads runs the archs of one file in parallel, so a job
  holds min(threads, archs) = 2 per-arch compiles at once: peak × 2, time × 1.
  (Measured here: bwd hdim128 for 100;120 with --threads 2 peaks at ~12 GiB,
  2× its one-arch peak.)
- ``threads``: the incident's own report, "3–5.5 GB per nvcc thread": peak ×
  threads = × 4, time × 1.
- ``fitted``: the factor between 2 and 4 (steps of 0.05) in the middle of the
  range for which the replay matches the incident (MAX_JOBS 32 OOMs, 20 passes).

Time: a job's wall time here is scaled by one factor chosen so that MAX_JOBS=20
takes 10 minutes, as in the incident (CPU speed and contention differ); the
ranking of the strategies does not depend on it. Each job uses min(threads,
archs) cores; above 128 busy threads every job slows evenly.

Run: .venv/bin/python -m benchmarks.build_simulate [--profiles DIR]
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.compile_simulate import SimJob, SimResult, simulate_fixed, simulate_scheduler
from pipeline.compile.profile import SHIPPED_PROFILES, Profile, ProfileEntry

CORES = 128
MEMORY = 432 * 10**9
HEADROOM = 8 * 2**30  # eyrie's --headroom on the incident host: setup.py, ninja, the link
BUDGET = MEMORY - HEADROOM
ARCHS, THREADS = 2, 4
INCIDENT_MINUTES_AT_20 = 10.0
HDIMS = (32, 64, 96, 128, 192, 256)


def flash_attn_sources() -> list[str]:
    """flash-attn 2.8.3's 72 .cu files in the order its ninja file lists them (sorted)."""
    names = []
    for kind in ("bwd", "fwd", "fwd_split"):
        for hdim in HDIMS:
            for dtype in ("bf16", "fp16"):
                for causal in ("_causal", ""):
                    names.append(f"flash_{kind}_hdim{hdim}_{dtype}{causal}_sm80.cu")
    return sorted(names)


def _kind_hdim(name: str) -> tuple[str, int]:
    match = re.match(r"flash_(bwd|fwd_split|fwd)_hdim(\d+)_", name)
    assert match, name
    return match.group(1), int(match.group(2))


def measured_for(name: str, entries: list[ProfileEntry]) -> ProfileEntry:
    by_source = {e.source: e for e in entries}
    if name in by_source:
        return by_source[name]
    kind, hdim = _kind_hdim(name)
    same_kind = [e for e in entries if _kind_hdim(e.source)[0] == kind]
    if not same_kind:
        raise SystemExit(f"no measured profile of a {kind} file: measure one first")
    return min(same_kind, key=lambda e: (abs(_kind_hdim(e.source)[1] - hdim), e.source))


def jobs_for(factor: float, entries: list[ProfileEntry], time_scale: float) -> list[SimJob]:
    in_flight = min(THREADS, ARCHS)
    waves = math.ceil(ARCHS / in_flight)
    jobs = []
    for name in flash_attn_sources():
        m = measured_for(name, entries)
        peak = int(m.anon_peak_bytes * factor)
        duration = m.wall_s * waves * time_scale
        jobs.append(SimJob(name, peak, duration, tuple(m.shape or [1.0]), threads=in_flight))
    return jobs


def time_scale(factor: float, entries: list[ProfileEntry]) -> float:
    """The factor that makes MAX_JOBS=20 take the incident's 10 minutes (memory unbounded)."""
    base = simulate_fixed(jobs_for(factor, entries, 1.0), 20, cores=CORES, memory=2**62)
    return INCIDENT_MINUTES_AT_20 * 60 / base.makespan


def matches_incident(factor: float, entries: list[ProfileEntry]) -> bool:
    jobs = jobs_for(factor, entries, time_scale(factor, entries))
    return (
        simulate_fixed(jobs, 32, cores=CORES, memory=MEMORY).oom_at is not None
        and simulate_fixed(jobs, 20, cores=CORES, memory=MEMORY).oom_at is None
    )


def fitted_factors(entries: list[ProfileEntry]) -> list[float]:
    """Per-job peak factors (× the one-arch, one-thread peak) for which the replay matches the incident."""
    return [f / 20 for f in range(40, 81) if matches_incident(f / 20, entries)]


@dataclass
class Replay:
    """One model's replay: every fixed MAX_JOBS, the scheduler, and the lower bounds."""

    jobs: list[SimJob]
    scale: float
    fixed: dict[int, SimResult]
    scheduler: SimResult
    held: SimResult
    """The same scheduler with each reservation held to the job's end (no shrink)."""
    low: SimResult
    """The scheduler when every job's real peak is 10% above its prediction."""

    @property
    def best(self) -> int | None:
        surviving = [j for j, r in self.fixed.items() if r.makespan is not None]
        return min(surviving, key=lambda j: self.fixed[j].makespan) if surviving else None

    @property
    def cpu_bound(self) -> float:
        """Σ(cpu-seconds) / cores: no schedule on these cores ends sooner."""
        return sum(j.duration * j.threads for j in self.jobs) / CORES

    @property
    def longest(self) -> float:
        """The longest job: no schedule ends before it does."""
        return max(j.duration for j in self.jobs)

    @property
    def memory_bound(self) -> float:
        """Σ(memory × time) / budget, each job at its shape: no schedule within the budget ends sooner."""
        return sum(j.peak * sum(j.shape) / len(j.shape) * j.duration for j in self.jobs) / BUDGET


def replay(factor: float, entries: list[ProfileEntry]) -> Replay:
    scale = time_scale(factor, entries)
    jobs = jobs_for(factor, entries, scale)
    fixed = {j: simulate_fixed(jobs, j, cores=CORES, memory=MEMORY) for j in [*range(1, 73), 128]}
    sched = simulate_scheduler(jobs, budget=BUDGET, cores=CORES, memory=MEMORY)
    held = simulate_scheduler(jobs, budget=BUDGET, cores=CORES, memory=MEMORY, shrink=False)
    under = [replace(j, predicted=int(j.peak / 1.1)) for j in jobs]
    low = simulate_scheduler(under, budget=BUDGET, cores=CORES, memory=MEMORY)
    return Replay(jobs, scale, fixed, sched, held, low)


def run(label: str, factor: float, entries: list[ProfileEntry]) -> list[str]:
    r = replay(factor, entries)
    peaks = sorted(j.peak for j in r.jobs)
    lines = [
        f"### {label}: per-job peak = one-arch peak × {factor:g} "
        f"({peaks[0] / 1e9:.1f}–{peaks[-1] / 1e9:.1f} GB), time scale ×{r.scale:.2f}",
        "",
        "| strategy | OOM | makespan | jobs done before OOM | peak memory | peak reserved | max parallel |",
        "|---|---|---|---|---|---|---|",
    ]
    best = r.best
    for max_jobs in sorted({128, 64, 48, 32, 24, 20, 16, *([best] if best else [])}, reverse=True):
        label_j = f"MAX_JOBS={max_jobs}" + (" (best fixed)" if max_jobs == best else "")
        lines.append(_row(label_j, r.fixed[max_jobs]))
    lines.append(_row("eyrie scheduler, reservations held to the end", r.held))
    lines.append(_row("eyrie scheduler, real peaks 10% above the predictions", r.low))
    lines.append(_row("eyrie scheduler", r.scheduler))
    lines.append("")
    lines.append(
        f"limits: Σ(cpu-seconds)/cores {r.cpu_bound / 60:.2f} min, Σ(memory × time)/budget "
        f"{r.memory_bound / 60:.2f} min, longest job {r.longest / 60:.2f} min"
    )
    if r.scheduler.makespan and best:
        oracle = r.fixed[best].makespan
        ratio = f"scheduler / best fixed (MAX_JOBS={best}): {r.scheduler.makespan / oracle:.2f}×"
        if r.fixed[20].makespan:
            ratio += f"; scheduler / MAX_JOBS=20: {r.scheduler.makespan / r.fixed[20].makespan:.2f}×"
        for what, result in (("held", r.held), ("10% low", r.low)):
            share = f"{result.makespan / oracle:.2f}×" if result.makespan else "OOM"
            ratio += f"; {what} / best fixed: {share}"
        lines.append(ratio)
    return lines


def _row(label: str, r: SimResult) -> str:
    oom = f"yes, at {r.oom_at / 60:.1f} min" if r.oom_at is not None else "no"
    makespan = f"{r.makespan / 60:.2f} min" if r.makespan is not None else "—"
    done = str(r.done_before_oom) if r.oom_at is not None else "72"
    reserved = f"{r.peak_reserved / 1e9:.0f} GB" if r.peak_reserved else "—"
    return (
        f"| {label} | {oom} | {makespan} | {done} | {r.peak_memory / 1e9:.0f} GB | {reserved} "
        f"| {r.max_parallel} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", type=Path, default=SHIPPED_PROFILES)
    args = parser.parse_args()
    profile = Profile.load([args.profiles], default_peak=1)
    entries = [e for e in profile.entries() if e.archs == ["120"] and e.threads == 1]
    print(
        f"{len(entries)} measured files (sm_120, --threads 1): "
        + ", ".join(f"{e.source} {e.anon_peak_bytes / 2**30:.2f} GiB {e.wall_s:.0f} s" for e in entries)
    )
    fitted = fitted_factors(entries)
    print(
        "\nfactors reproducing the incident (MAX_JOBS 32 OOM, 20 passes): "
        + (f"{fitted[0]:g}–{fitted[-1]:g}" if fitted else "none in 2–4")
    )
    models = [
        ("model `archs` (nvcc runs min(threads, archs) = 2 archs at once)", float(min(THREADS, ARCHS))),
        ("model `threads` (the incident's per-thread report: × threads = 4)", float(THREADS)),
    ]
    if fitted:
        middle = fitted[len(fitted) // 2]
        models.append(("model `fitted` (middle of the factors that reproduce the incident)", middle))
    for label, factor in models:
        print()
        print("\n".join(run(label, factor, entries)))


if __name__ == "__main__":
    main()
