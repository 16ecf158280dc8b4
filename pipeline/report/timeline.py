"""A run on one clock: the host's memory and every attempt's, and what ran beside what.

The ledger keeps each attempt's timeline relative to its start, one point per
window of about a second holding the window's highest memory, a compile job's
reservation at each change, and the host's memory one row a second holding that
second's least MemAvailable (none where the steps ran on other machines). This
module puts them on the run's wall clock, for the report's run chart and for
``explain``'s account of an attempt's neighbours.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.run.host_sampler import SAMPLE_S
from pipeline.run.ledger import AttemptRow, HostSample, Ledger
from pipeline.run.verdict import MEMORY_VERDICTS, OOM_KILL_VERDICTS, Verdict

# The ledger holds verdicts as their names.
OOM_KILL_ENDINGS = frozenset(verdict.value for verdict in OOM_KILL_VERDICTS)
MEMORY_ENDINGS = frozenset(verdict.value for verdict in MEMORY_VERDICTS)
CRASH_ENDINGS = frozenset({Verdict.CRASHED.value, Verdict.COMPLETED_THEN_CRASHED.value})


@dataclass(frozen=True)
class Track:
    """One attempt on the run's clock: its memory at the end of each window, each the window's highest.

    ``totals`` is what its cgroup was charged (page cache included: what the limit counts),
    ``anons`` its anonymous memory (what the host cannot reclaim from it).
    """

    row: AttemptRow
    start: float
    end: float
    ends: list[float]
    totals: list[int]
    anons: list[int]
    held_from: list[float] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    """A compile job's reservations: ``held[i]`` from ``held_from[i]`` until the next change."""

    def held_at(self, t: float) -> int:
        """What the attempt held of the budget at ``t``: its reservation then, else its limit."""
        if not self.held:
            return self.row.limit_bytes
        return self.held[max(0, bisect.bisect_right(self.held_from, t) - 1)]

    def usage_at(self, t: float, *, anon: bool = False) -> int | None:
        """Memory at ``t``: the highest of the window holding ``t``; None outside the attempt."""
        return self.usage_between(t, t, anon=anon)

    def usage_between(self, t0: float, t1: float, *, anon: bool = False) -> int | None:
        """The highest memory of the windows that overlap [t0, t1]; None when the attempt did not run."""
        if t1 < self.start or t0 > self.end:
            return None
        if not self.ends:
            return 0
        first = min(bisect.bisect_left(self.ends, t0), len(self.ends) - 1)
        last = min(bisect.bisect_left(self.ends, t1), len(self.ends) - 1)
        return max((self.anons if anon else self.totals)[first : last + 1])

    @property
    def event(self) -> tuple[float, str] | None:
        """When and what to mark: the OOM kill, or the end of an attempt that crashed or ran out."""
        verdict = self.row.verdict
        if verdict in OOM_KILL_ENDINGS:
            return (self.row.oom_at or self.end, "OOM kill")
        if verdict == Verdict.MEMORY_ERROR.value:
            return (self.end, "memory error")
        if verdict in CRASH_ENDINGS:
            return (self.end, "crash")
        return None


@dataclass(frozen=True)
class RunTimeline:
    run: dict[str, Any]
    start: float
    end: float
    host: list[HostSample]
    tracks: list[Track]
    host_times: list[float] = field(init=False)

    @property
    def steps_elsewhere(self) -> bool:
        """The run's steps ran on machines its runner could not see (Slurm's nodes): no host samples."""
        return self.run.get("host_sampled") == 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "host_times", [s.t for s in self.host])

    def host_between(self, t0: float, t1: float) -> HostSample | None:
        """The least memory the host had in the seconds overlapping [t0, t1]; None without samples."""
        times = self.host_times
        first = bisect.bisect_left(times, t0)
        last = min(bisect.bisect_left(times, t1), len(times) - 1)
        window = self.host[first : last + 1] if first < len(times) else self.host[-1:]
        if not window:
            return None
        return min(window, key=lambda s: s.available)

    def host_at(self, t: float) -> HostSample | None:
        """What the host had at ``t``, and in the second before it (an OOM kill frees memory at once)."""
        return self.host_between(t - SAMPLE_S, t)

    def running_at(self, t: float) -> list[Track]:
        return [track for track in self.tracks if track.start <= t <= track.end]


def run_timeline(ledger: Ledger, run: dict[str, Any]) -> RunTimeline:
    """One run of the ledger on its clock."""
    run_id = run["run_id"]
    host = ledger.host_samples(run_id)
    rows = ledger.attempts_of(run_id)
    reservations = ledger.reservations()
    end = run["ended_at"] or time.time()
    seen = ledger.last_seen(run_id)
    if seen is not None:
        # A runner killed without warning leaves its run open until the next run closes it:
        # its last host sample or heartbeat, not that later moment, is when it was last seen.
        end = min(end, seen + SAMPLE_S)
    start = min([run["started_at"], *(row.started_at for row in rows)])
    end = max([end, start, *(row.started_at for row in rows)])
    tracks = []
    for row in rows:
        points = ledger.timeline(row.id)
        held = reservations.get(row.id, [])
        track_end = min(row.ended_at or end, end)
        tracks.append(
            Track(
                row=row,
                start=row.started_at,
                end=max(track_end, row.started_at),
                ends=[row.started_at + p[0] for p in points],
                totals=[p[1] for p in points],
                anons=[p[2] for p in points],
                held_from=[r["t"] for r in held],
                held=[r["reserved_bytes"] for r in held],
            )
        )
    return RunTimeline(run=run, start=start, end=end, host=host, tracks=tracks)


def clock(ts: float | None) -> str:
    """A wall-clock time as people read it on this host: ``15:30:01``."""
    return "-" if ts is None else time.strftime("%H:%M:%S", time.localtime(ts))


def timeline_of(ledger: Ledger, row: AttemptRow) -> RunTimeline | None:
    """The run an attempt belongs to, on its clock."""
    run = ledger.run(row.run_id)
    return None if run is None else run_timeline(ledger, run)
