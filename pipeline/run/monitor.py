"""Watches one step's cgroup while it runs: memory timeline, anonymous peak, OOM kills.

The kernel's own notification (inotify on v2 ``memory.events``, an eventfd on
v1 ``memory.oom_control``) wakes the monitor at once; between events it polls
every 0.1 s, which alone keeps the recorded time of an OOM kill within a
fraction of a second (the ledger's promise is "within a second"). Timeline
points are kept about once a second, each the maximum of its window, so a
short spike is not lost between points; the first ones come sooner (the first
within 0.1 s of the start), so a step that lives a second is drawn as it grew,
not as its peak from the start.

A cgroup whose anonymous memory fills its limit can live-lock instead of being
OOM-killed: the kernel keeps reclaiming the processes' own program text, which
they read straight back in, so reclaim never fails and the OOM killer never
runs (four cicc's under 2.5 GiB stayed at the limit for 7 minutes, reading
~70 pages a second back in). As systemd-oomd does on memory pressure, the
monitor calls such an attempt out of memory once it has stayed so for
``THRASH_S`` seconds, and its owner kills it.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.memory import Cgroup, MemorySample
from pipeline.memory.events import event_notifier
from pipeline.memory.units import MIB, format_size

POLL_S = 0.1
FAST_POLL_S = 0.005
FAST_WINDOW_S = 0.5
TIMELINE_S = 1.0
# When the first timeline points are due, in seconds from the start: then one every TIMELINE_S.
FIRST_POINTS_S = (0.05, 0.25, 0.5, 0.75, 1.0)
THRASH_S = 20.0
# Pages read back in per second, on average over THRASH_S, that make "at the limit" thrashing.
THRASH_FAULTS_PER_S = 10
# Anonymous memory within this much of the limit (or 2% of it, if more) leaves the page cache
# too little room for the processes' own code.
THRASH_HEADROOM = 64 * MIB


@dataclass
class MonitorReport:
    oom_kills_before: int
    oom_kills_after: int
    oom_at: float | None
    peak_bytes: int | None
    anon_peak_bytes: int | None
    timeline: list[tuple[float, int, int]] = field(default_factory=list)
    thrash: str | None = None
    """The evidence, when the attempt was called out of memory for thrashing at its limit."""


class ThrashWatch:
    """Tells when anonymous memory has held a cgroup at its limit for ``after_s`` seconds while
    its processes kept reading their pages back in."""

    def __init__(self, limit: int | None, after_s: float = THRASH_S) -> None:
        self.limit = limit
        self.after_s = after_s
        self._since: tuple[float, int] | None = None

    def observe(self, now: float, sample: MemorySample) -> str | None:
        """The evidence once the cgroup has thrashed for ``after_s``; None until then."""
        if self.limit is None or sample.anon < self.limit - max(THRASH_HEADROOM, self.limit // 50):
            self._since = None
            return None
        if self._since is None:
            self._since = (now, sample.major_faults)
            return None
        since, faults_then = self._since
        held_s = now - since
        if held_s < self.after_s:
            return None
        read_back = sample.major_faults - faults_then
        if read_back < THRASH_FAULTS_PER_S * held_s:
            self._since = (now, sample.major_faults)  # at the limit but steady: not thrashing
            return None
        return (
            f"its anonymous memory held {format_size(sample.anon)} of its {format_size(self.limit)} "
            f"limit for {held_s:.0f} s, leaving {format_size(sample.file)} of page cache, while it "
            f"read {read_back} pages back in ({read_back / held_s:.0f}/s): thrashing, which the "
            "kernel never OOM-kills"
        )


class CgroupMonitor:
    def __init__(
        self, cgroup: Cgroup, on_thrash: Callable[[], None] | None = None, thrash_after_s: float = THRASH_S
    ) -> None:
        """``on_thrash``, where given, is called once, to kill the attempt, when it thrashes."""
        self.cgroup = cgroup
        self._on_thrash = on_thrash
        self._watch = ThrashWatch(cgroup.limit(), thrash_after_s) if on_thrash else None
        self._thrash: str | None = None
        self.started = time.time()
        self._before = cgroup.oom_kills()
        self._last_kills = self._before
        self._oom_at: float | None = None
        self._total_peak = 0
        self._anon_peak = 0
        self._window: tuple[int, int] = (0, 0)
        self._timeline: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._notifier = event_notifier(cgroup)
        self._wake_r, self._wake_w = os.pipe()  # lets finish() interrupt a wait at once
        self._thread = threading.Thread(target=self._loop, name=f"monitor-{cgroup.path.name}", daemon=True)

    def start(self) -> CgroupMonitor:
        self._poll()
        self._thread.start()
        return self

    def _poll(self) -> None:
        now = time.time()
        try:
            kills = self.cgroup.oom_kills()
            sample = self.cgroup.sample()
        except (FileNotFoundError, OSError):
            return  # the cgroup went away (a container removed): keep what was seen
        if kills > self._last_kills and self._oom_at is None:
            self._oom_at = now
        self._last_kills = max(self._last_kills, kills)
        self._total_peak = max(self._total_peak, sample.total)
        self._anon_peak = max(self._anon_peak, sample.anon)
        self._window = (max(self._window[0], sample.total), max(self._window[1], sample.anon))
        if now >= self._point_due():
            self._timeline.append((round(now - self.started, 3), *self._window))
            self._window = (0, 0)
        if self._watch is not None and self._thrash is None:
            self._thrash = self._watch.observe(now, sample)
            if self._thrash is not None:
                self._on_thrash()

    def _point_due(self) -> float:
        """When the next timeline point is due (wall clock)."""
        last = self._timeline[-1][0] if self._timeline else 0.0
        first = next((t for t in FIRST_POINTS_S if t > last), None)
        return self.started + (last + TIMELINE_S if first is None else first)

    def _loop(self) -> None:
        fast_until = 0.0
        watched = [self._wake_r] + ([self._notifier.fileno()] if self._notifier else [])
        while not self._stop.is_set():
            interval = FAST_POLL_S if time.monotonic() < fast_until else POLL_S
            # Wake when a point is due, so the first ones are read when they are promised.
            interval = max(0.0, min(interval, self._point_due() - time.time()))
            ready, _, _ = select.select(watched, [], [], interval)
            if self._notifier is not None and self._notifier.fileno() in ready:
                self._notifier.drain()
                # v1 signals when the cgroup runs out of memory, a moment before the kill is
                # counted: look closely for a while.
                fast_until = time.monotonic() + FAST_WINDOW_S
            self._poll()

    def finish(self) -> MonitorReport:
        """Stop watching; read the counters one last time (the cgroup must still exist)."""
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join()
        self._poll()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        if self._notifier is not None:
            self._notifier.close()
        if self._window != (0, 0):
            self._timeline.append((round(time.time() - self.started, 3), *self._window))
        try:
            kernel_peak = self.cgroup.peak()
        except OSError:
            kernel_peak = None
        return MonitorReport(
            oom_kills_before=self._before,
            oom_kills_after=self._last_kills,
            oom_at=self._oom_at,
            peak_bytes=max(kernel_peak or 0, self._total_peak) or None,
            anon_peak_bytes=self._anon_peak or None,
            timeline=self._timeline,
            thrash=self._thrash,
        )
