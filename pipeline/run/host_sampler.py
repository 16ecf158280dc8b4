"""Records the memory the steps share in the ledger for a run's whole life, not only inside its steps.

Each step's monitor watches the step's own cgroup; this thread watches what is
around them, as the executor that runs them sees it (``Executor.host_memory``):
for local steps, what the runner's cgroups and the host really leave it (the
figure ``eyrie memory`` calls the budget); for step containers, the Docker
host's MemAvailable, whatever limit the runner's own container has. With it a
report can say what the whole machine was doing when a step died. It polls four
times a second and keeps one row a second, the least memory seen in that
second, so a short dip is not lost between rows.

An executor whose steps run on machines this one cannot see (Slurm's nodes)
has no such view: then each second is a heartbeat instead, so that whoever
follows the run can still tell a live runner from a dead one. Once the disk is
full (the ledger gave back its reserve), one row every ``SHORT_OF_SPACE_S``.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable

from pipeline.memory import Budget, CgroupError
from pipeline.run.ledger import HostSample, Ledger

POLL_S = 0.25
SAMPLE_S = 1.0
SHORT_OF_SPACE_S = 10.0  # one row this often once the disk is full (a runner is gone after 15 s silent)


class HostSampler:
    def __init__(self, ledger: Ledger, run_id: str, read: Callable[[], Budget] | None) -> None:
        """``read``: the memory the steps share, as their executor sees it; None: heartbeats only."""
        self.ledger = ledger
        self.run_id = run_id
        self._read = read
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
                # On a full disk each row spends what the ledger kept back for the verdicts.
                next_flush += SHORT_OF_SPACE_S if self.ledger.reserve_given_back else SAMPLE_S

    def _poll(self) -> None:
        if self._read is None:
            return
        try:
            budget = self._read()
        except (OSError, CgroupError):
            return  # a cgroup file vanished mid-read: the next poll reads again
        seen = HostSample(
            time.time(), budget.mem_total, budget.mem_available, budget.available, _capacity(budget)
        )
        window = self._window
        if window is not None:
            seen = HostSample(
                seen.t,
                seen.mem_total,
                min(seen.mem_available, window.mem_available),
                min(seen.available, window.available),
                min(seen.pool, window.pool),
            )
        self._window = seen

    def _flush(self) -> None:
        window, self._window = self._window, None
        try:
            if window is None:
                self.ledger.heartbeat(self.run_id)  # no reading this second: the runner still lives
            else:
                self.ledger.add_host_sample(self.run_id, window)
        except sqlite3.Error:
            pass  # a busy or failing disk must not stop the run: this second goes unrecorded


def _capacity(budget: Budget) -> int:
    """What ``budget.available`` is left of: the limit of the cgroup whose headroom it is, else
    (MemAvailable binds) MemTotal."""
    binding = [r.limit for r in budget.cgroups if r.limit is not None and r.headroom == budget.available]
    return min(binding, default=budget.mem_total)
