"""Admission by memory: a compile job starts only when its predicted peak fits the budget.

The scheduler is bookkeeping, with no clock and no processes: the build broker
drives it with real jobs and threads, the incident simulation
(``benchmarks/build_simulate.py``) with a virtual clock, so both run the very
same decisions.

Rules:
- A job reserves its predicted peak. It is admitted when the reservations of the
  running jobs plus its own fit the budget and a CPU slot is free (a job takes
  as many slots as nvcc compiles architectures at once).
- Waiting jobs are tried largest memory × time first (predicted peak × predicted
  wall time; a job never measured counts as the longest): the jobs that weigh
  most on the build start early instead of ending it alone, small ones fill the gaps.
- Once a running job's peak is behind it, its reservation shrinks to what its
  measured shape still needs (``ShapeWatch``), and waiting jobs take the rest.
- When nothing runs, the head job is admitted whatever it reserves, clipped to
  the budget: a build always makes progress.
- A job OOM-killed under its own limit is re-queued reserving its observed peak
  × ``RETRY_GROWTH`` (at most the whole budget). Killed while holding the whole
  budget, it cannot fit, and the build fails with the numbers.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.memory.units import format_size

RETRY_GROWTH = 2.0
"""Killed at its limit, a job shows only that it needs more than the limit; doubling
bounds the retries at log2(budget / first guess) while rarely over-reserving by more than 2×."""


PEAK_SEEN = 0.75
"""A job's memory at this fraction of its predicted peak or above is "at its peak". The
measured shapes climb to 1.0 and fall to about 0.3 within one or two of their 20 points,
so the level decides little; below 0.75 a ramp's last steps would count as a peak passed."""
SETTLED_READINGS = 3
"""Readings in a row (one a second) within the shape's tail before a reservation shrinks: a
process freeing one buffer before it allocates the next dips for a moment, and rises again."""


class BudgetTooSmall(RuntimeError):
    """A job needs more memory than the whole budget; the message gives the numbers."""


def _humps(values: list[float] | tuple[float, ...], level: float) -> int:
    """How many times the values rise to ``level`` or above."""
    count, above = 0, False
    for value in values:
        if value >= level and not above:
            count += 1
        above = value >= level
    return count


class ShapeWatch:
    """Follows a running job's memory against its measured shape: has its peak passed?

    A shape is the job's anonymous memory at 20 moments as fractions of its peak.
    Its peak is behind it once its live memory has risen to ``PEAK_SEEN`` × the
    predicted peak as many times as the shape does (one hump, or one per arch when
    nvcc compiles the archs one after the other) and has fallen below it again;
    from then on it needs the largest fraction the shape still holds (its tail).
    The reservation shrinks only once the live memory has stayed at or below that
    tail for ``SETTLED_READINGS`` readings: a job running above its shape keeps
    what it reserved. Time plays no part, so
    a job slowed by a busy host is judged by its memory alone.
    """

    def __init__(self, peak: int, shape: list[float] | tuple[float, ...], margin: float) -> None:
        self.peak, self.margin = peak, margin
        self._humps = _humps(shape, PEAK_SEEN)
        last_high = max((i for i, v in enumerate(shape) if v >= PEAK_SEEN), default=len(shape))
        tail = shape[last_high + 1 :]
        self.tail = max(tail) if tail else None
        self._seen, self._above, self._settled = 0, False, 0

    def rest(self, anon: int) -> int | None:
        """The reservation the job still needs, given its memory now; None while its peak may lie ahead."""
        above = anon >= PEAK_SEEN * self.peak
        if above and not self._above:
            self._seen += 1
        self._above = above
        if self.tail is None or self._seen < self._humps or above:
            self._settled = 0
            return None
        tail_bytes = self.tail * self.peak
        self._settled = self._settled + 1 if anon <= tail_bytes else 0
        if self._settled < SETTLED_READINGS:
            return None
        return math.ceil(tail_bytes * self.margin)


@dataclass(eq=False)
class Job:
    name: str
    reservation: int
    slots: int = 1
    basis: str = ""
    attempt: int = 1
    key: object = None
    """What the caller predicts this job's peak from (see ``release``)."""
    wall_s: float | None = None
    """Predicted wall time; None for a job never measured (ordered as the longest)."""
    expected: int | None = None
    """The peak expected from measurements, without the margin; None for a default guess."""
    watch: ShapeWatch | None = None
    """Set by the caller when the job's shape is known: its reservation may then shrink."""
    seq: int = 0
    admitted: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def weight(self) -> float:
        """What the job weighs on the build: memory × time (a job never measured: the longest)."""
        return self.reservation * (self.wall_s if self.wall_s is not None else math.inf)


class AdmissionScheduler:
    def __init__(self, budget: int, cpu_slots: int) -> None:
        if budget <= 0:
            raise ValueError(f"memory budget must be positive, got {budget}")
        self.budget = budget
        self.cpu_slots = max(1, cpu_slots)
        self.waiting: list[Job] = []
        self.running: list[Job] = []
        self.peak_reserved = 0
        self._seq = itertools.count()
        self._lock = threading.RLock()

    @property
    def reserved(self) -> int:
        return sum(j.reservation for j in self.running)

    @property
    def slots_used(self) -> int:
        return sum(j.slots for j in self.running)

    def submit(self, job: Job) -> list[Job]:
        """Queue a job; returns the jobs admitted now (possibly this one)."""
        with self._lock:
            job.reservation = min(job.reservation, self.budget)
            job.seq = next(self._seq)
            self.waiting.append(job)
            return self._dispatch()

    def release(self, job: Job, repredict: Callable[[Job], int] | None = None) -> list[Job]:
        """A job ended; returns the jobs admitted in its place.

        ``repredict`` gives waiting first attempts a new reservation: what the ended
        job measured corrects the guesses made before it finished.
        """
        with self._lock:
            self.running.remove(job)
            if repredict is not None:
                for waiting in self.waiting:
                    if waiting.attempt == 1:
                        waiting.reservation = min(self.budget, repredict(waiting))
            return self._dispatch()

    def shrink(self, job: Job, reservation: int) -> list[Job]:
        """A running job needs less from now on; returns the jobs admitted in the memory it gave back."""
        with self._lock:
            if job not in self.running or reservation >= job.reservation:
                return []
            job.reservation = reservation
            return self._dispatch()

    def requeue_after_oom(self, job: Job, observed_peak: int) -> list[Job]:
        """A job was OOM-killed under its reservation: re-queue it with the observed figure, grown."""
        with self._lock:
            self.running.remove(job)
            if job.reservation >= self.budget:
                raise BudgetTooSmall(
                    f"{job.name} was OOM-killed holding the whole budget of "
                    f"{format_size(self.budget, 'GiB')} (observed peak {format_size(observed_peak, 'GiB')}): "
                    "it cannot be built within this budget; "
                    "give it more memory (--budget) or fewer nvcc threads/archs per job"
                )
            job.reservation = min(self.budget, int(max(observed_peak, job.reservation) * RETRY_GROWTH))
            job.basis = (
                f"OOM-killed at {format_size(observed_peak, 'GiB')}: "
                f"retry reserving {format_size(job.reservation, 'GiB')}"
            )
            job.attempt += 1
            job.watch, job.expected = None, None  # under-predicted once: the retry keeps what it reserves
            job.admitted.clear()
            job.seq = next(self._seq)
            self.waiting.append(job)
            return self._dispatch()

    def abort(self) -> None:
        """Wake every waiting job (the build is failing); each must still ``release`` itself."""
        with self._lock:
            for job in list(self.waiting):
                self.waiting.remove(job)
                self.running.append(job)
                job.admitted.set()

    def _dispatch(self) -> list[Job]:
        admitted: list[Job] = []
        for job in sorted(self.waiting, key=lambda j: (-j.weight, -j.reservation, j.seq)):
            fits_memory = self.reserved + job.reservation <= self.budget
            fits_cpu = self.slots_used + job.slots <= self.cpu_slots
            if (fits_memory and fits_cpu) or not self.running:
                self.waiting.remove(job)
                self.running.append(job)
                admitted.append(job)
                self.peak_reserved = max(self.peak_reserved, self.reserved)
        for job in admitted:
            job.admitted.set()
        return admitted
