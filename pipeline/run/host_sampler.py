"""Records the host's memory in the ledger for a run's whole life, not only inside its steps.

Each step's monitor watches the step's own cgroup; this thread watches what is
around them: MemAvailable, and what the runner's cgroups and the host really
leave it (the figure ``eyrie memory`` calls the budget). With it a report can
say what the whole machine was doing when a step died. It polls four times a
second and keeps one row a second, the least memory seen in that second, so a
short dip is not lost between rows.
"""

from __future__ import annotations

import sqlite3
import threading
import time

from pipeline.memory import Cgroup, CgroupError, current_cgroup, memory_budget
from pipeline.run.ledger import HostSample, Ledger

POLL_S = 0.25
SAMPLE_S = 1.0


class HostSampler:
    def __init__(self, ledger: Ledger, run_id: str) -> None:
        self.ledger = ledger
        self.run_id = run_id
        try:
            self._own: Cgroup | None = current_cgroup()
        except CgroupError:
            self._own = None  # no memory cgroup: MemAvailable alone says what there is
        self._window: HostSample | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="host-sampler", daemon=True)

    def start(self) -> HostSampler:
        self._poll()
        self._flush()  # the run's first moment, before any step starts
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop, and record the last (partial) second."""
        self._stop.set()
        self._thread.join()
        self._poll()
        self._flush()

    def _loop(self) -> None:
        next_flush = time.monotonic() + SAMPLE_S
        while not self._stop.wait(POLL_S):
            self._poll()
            if time.monotonic() >= next_flush:
                self._flush()
                next_flush += SAMPLE_S

    def _poll(self) -> None:
        try:
            budget = memory_budget(cgroup=self._own)
        except (OSError, CgroupError):
            return  # a cgroup file vanished mid-read: the next poll reads again
        seen = HostSample(time.time(), budget.mem_total, budget.mem_available, budget.available)
        window = self._window
        if window is not None:
            seen = HostSample(
                seen.t,
                seen.mem_total,
                min(seen.mem_available, window.mem_available),
                min(seen.available, window.available),
            )
        self._window = seen

    def _flush(self) -> None:
        window, self._window = self._window, None
        if window is None:
            return
        try:
            self.ledger.add_host_sample(self.run_id, window)
        except sqlite3.Error:
            pass  # a busy or failing disk must not stop the run: this second goes unrecorded
