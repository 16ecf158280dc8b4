"""A build replayed on a virtual clock: fixed MAX_JOBS (ninja's order) or the memory scheduler.

Each job has a peak, a duration and a memory shape (its anonymous memory over
time, as fractions of the peak, from a measured timeline). The machine has
``cores`` and ``memory`` bytes. Time advances in ``dt`` steps; a job progresses
at ``1/duration`` per second, slowed evenly when the running jobs want more
threads than there are cores. When the memory of the running jobs exceeds the
machine's, the kernel OOM-kills one and the build fails (ninja stops at the
first failed job) — for the scheduler too, which is what its predictions must avoid.

The scheduler sees what the broker sees: each job's predicted peak, wall time
and shape, and each running job's memory every ``dt`` (the broker samples once a
second), from which ``ShapeWatch`` shrinks reservations once peaks have passed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipeline.compile.profile import SAFETY_MARGIN
from pipeline.compile.scheduler import AdmissionScheduler, Job, ShapeWatch


@dataclass(frozen=True)
class SimJob:
    name: str
    peak: int
    duration: float
    shape: tuple[float, ...] = (1.0,)
    threads: int = 1
    predicted: int = 0
    """The peak the scheduler expects (0: the true one); it reserves that × the margin."""

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
    peak_reserved: int = 0
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

    def in_use(self, name: str) -> int:
        return self.by_name[name].memory_at(self.running[name])

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
        in_use = sum(self.in_use(n) for n in self.running)
        r = self.result
        r.peak_memory = max(r.peak_memory, in_use)
        r.max_parallel = max(r.max_parallel, len(self.running))
        if int(self.t / self.dt) % max(1, int(10 / self.dt)) == 0:
            r.timeline.append((round(self.t, 1), in_use, len(self.running)))
        if in_use > self.memory and r.oom_at is None:
            r.oom_at, r.done_before_oom = self.t, self.done
        return finished


def simulate_fixed(
    jobs: list[SimJob], max_jobs: int, *, cores: int, memory: int, dt: float = 1.0
) -> SimResult:
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


def simulate_scheduler(
    jobs: list[SimJob],
    *,
    budget: int,
    cores: int,
    memory: int,
    dt: float = 1.0,
    margin: float = SAFETY_MARGIN,
    shrink: bool = True,
) -> SimResult:
    """The AdmissionScheduler (the one the build broker uses) with every job waiting from t=0."""
    clock = _Clock(jobs, cores, memory, dt, "scheduler")
    scheduler = AdmissionScheduler(budget, cores)
    handles = {}
    for j in jobs:
        predicted = j.predicted or j.peak
        watch = ShapeWatch(predicted, j.shape, margin) if shrink else None
        handles[j.name] = Job(
            j.name, math.ceil(predicted * margin), slots=j.threads, wall_s=j.duration, watch=watch
        )
    for job in jobs:
        for admitted in scheduler.submit(handles[job.name]):
            clock.running[admitted.name] = 0.0
    while clock.running:
        for name in clock.step():
            for admitted in scheduler.release(handles[name]):
                clock.running[admitted.name] = 0.0
        for name in list(clock.running):
            job = handles[name]
            rest = job.watch.rest(clock.in_use(name)) if job.watch else None
            if rest is not None:
                job.watch = None  # one shrink, as the broker does
                for admitted in scheduler.shrink(job, rest):
                    clock.running[admitted.name] = 0.0
        clock.result.peak_reserved = max(clock.result.peak_reserved, scheduler.reserved)
        if clock.result.oom_at is not None:
            return clock.result
    clock.result.makespan = clock.t
    return clock.result
