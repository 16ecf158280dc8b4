"""A build replayed on a virtual clock: fixed MAX_JOBS (ninja's order) or the memory scheduler.

Each job has a peak, a duration and a memory shape (its anonymous memory over
time, as fractions of the peak, from a measured timeline). The machine has
``cores`` and ``memory`` bytes. Time advances in ``dt`` steps; a job progresses
at ``1/duration`` per second, slowed evenly when the running jobs want more
threads than there are cores. When the memory of the running jobs exceeds the
machine's, the kernel OOM-kills one and the build fails (ninja stops at the
first failed job) — for the scheduler too, which is what its predictions must avoid.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.compile.scheduler import AdmissionScheduler, Job


@dataclass(frozen=True)
class SimJob:
    name: str
    peak: int
    duration: float
    shape: tuple[float, ...] = (1.0,)
    threads: int = 1
    predicted: int = 0
    """What the scheduler reserves for it (0: its peak)."""

    def memory_at(self, progress: float) -> int:
        index = min(len(self.shape) - 1, int(progress * len(self.shape)))
        return int(self.peak * self.shape[index])


@dataclass
class SimResult:
    label: str
    makespan: float | None
    """Seconds to build everything; None when the build was OOM-killed."""
    oom_at: float | None = None
    done_before_oom: int = 0
    peak_memory: int = 0
    max_parallel: int = 0
    timeline: list[tuple[float, int, int]] = field(default_factory=list)
    """(t, memory in use, jobs running) every ``sample_every`` seconds."""


class _Clock:
    def __init__(self, jobs: list[SimJob], cores: int, memory: int, dt: float, label: str) -> None:
        self.jobs, self.cores, self.memory, self.dt = jobs, cores, memory, dt
        self.running: dict[str, float] = {}  # name -> progress 0..1
        self.by_name = {j.name: j for j in jobs}
        self.result = SimResult(label, None)
        self.t = 0.0
        self.done = 0

    def step(self) -> list[str]:
        """Advance dt; returns the jobs that finished. Sets oom_at if memory overflowed."""
        demand = sum(self.by_name[n].threads for n in self.running)
        slow = min(1.0, self.cores / demand) if demand else 1.0
        finished = []
        for name in list(self.running):
            job = self.by_name[name]
            self.running[name] += self.dt * slow / job.duration
            if self.running[name] >= 1.0:
                finished.append(name)
                del self.running[name]
        self.t += self.dt
        self.done += len(finished)
        in_use = sum(self.by_name[n].memory_at(p) for n, p in self.running.items())
        r = self.result
        r.peak_memory = max(r.peak_memory, in_use)
        r.max_parallel = max(r.max_parallel, len(self.running))
        if int(self.t / self.dt) % max(1, int(10 / self.dt)) == 0:
            r.timeline.append((round(self.t, 1), in_use, len(self.running)))
        if in_use > self.memory and r.oom_at is None:
            r.oom_at, r.done_before_oom = self.t, self.done
        return finished


def simulate_fixed(jobs: list[SimJob], max_jobs: int, *, cores: int, memory: int,
                   dt: float = 1.0) -> SimResult:  # fmt: skip
    """ninja -j max_jobs: jobs start in file order whenever fewer than max_jobs run."""
    clock = _Clock(jobs, cores, memory, dt, f"MAX_JOBS={max_jobs}")
    queue = list(jobs)
    while queue or clock.running:
        while queue and len(clock.running) < max_jobs:
            clock.running[queue.pop(0).name] = 0.0
        clock.step()
        if clock.result.oom_at is not None:
            return clock.result
    clock.result.makespan = clock.t
    return clock.result


def simulate_scheduler(jobs: list[SimJob], *, budget: int, cores: int, memory: int,
                       dt: float = 1.0) -> SimResult:  # fmt: skip
    """The AdmissionScheduler (the one the build broker uses) with every job waiting from t=0."""
    clock = _Clock(jobs, cores, memory, dt, "scheduler")
    scheduler = AdmissionScheduler(budget, cores)
    handles = {j.name: Job(j.name, j.predicted or j.peak, slots=j.threads) for j in jobs}
    for job in jobs:
        for admitted in scheduler.submit(handles[job.name]):
            clock.running[admitted.name] = 0.0
    while clock.running:
        for name in clock.step():
            for admitted in scheduler.release(handles[name]):
                clock.running[admitted.name] = 0.0
        if clock.result.oom_at is not None:
            return clock.result
    clock.result.makespan = clock.t
    return clock.result
