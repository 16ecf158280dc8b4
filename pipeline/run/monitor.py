"""Watches one step's cgroup while it runs: memory timeline, anonymous peak, OOM kills.

The kernel's own notification (inotify on v2 ``memory.events``, an eventfd on
v1 ``memory.oom_control``) wakes the monitor at once; between events it polls
every 0.1 s, which alone keeps the recorded time of an OOM kill within a
fraction of a second (the ledger's promise is "within a second"). Timeline
points are kept about once a second, each the maximum of its window, so a
short spike is not lost between points; the first ones come sooner (the first
within 0.1 s of the start), so a step that lives a second is drawn as it grew,
not as its peak from the start.
"""

from __future__ import annotations

import os
import select
import threading
import time
from dataclasses import dataclass, field

from pipeline.memory import Cgroup
from pipeline.memory.events import event_notifier

POLL_S = 0.1
FAST_POLL_S = 0.005
FAST_WINDOW_S = 0.5
TIMELINE_S = 1.0
# When the first timeline points are due, in seconds from the start: then one every TIMELINE_S.
FIRST_POINTS_S = (0.05, 0.25, 0.5, 0.75, 1.0)


@dataclass
class MonitorReport:
    oom_kills_before: int
    oom_kills_after: int
    oom_at: float | None
    peak_bytes: int | None
    anon_peak_bytes: int | None
    timeline: list[tuple[float, int, int]] = field(default_factory=list)


class CgroupMonitor:
    def __init__(self, cgroup: Cgroup) -> None:
        self.cgroup = cgroup
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
        )
