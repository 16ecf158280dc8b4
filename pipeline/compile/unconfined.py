"""Running compile jobs where no cgroup can be created: inside ``docker build``.

A BuildKit RUN step sees its cgroup read-only, and BuildKit cannot limit one
build's memory. There the broker still admits jobs by predicted peak against
the budget (what the builder's cgroup allows), but a job runs as a plain
process tree: its peak is the largest sum of the tree's anonymous memory seen
in /proc, and an OOM kill is the enclosing cgroup's ``oom_kill`` counter rising
while a process of the job died of SIGKILL — the main process itself, or a
compiler child it reports with exit 137 (nvcc does, for a killed cicc or
ptxas). That counter is shared by every job running at once, so a rise counts
against no other job: one that exited 0, or failed any other way, was not the
one killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from pipeline.memory import KIB, Cgroup, CgroupError, current_cgroup
from pipeline.run.executor import STOP_GRACE_S, Launch, LineCapture, Outcome

POLL_S = 0.2


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def tree_anon_bytes(pid: int) -> int:
    """Anonymous memory (RssAnon) of a process and all its descendants."""
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    total += int(line.split()[1]) * KIB
                    break
        except (FileNotFoundError, ProcessLookupError):
            continue
        stack += _children(current)
    return total


class UnconfinedAttempt:
    def __init__(self, launch: Launch, enclosing: Cgroup | None) -> None:
        self.enclosing = enclosing
        self.where = f"process tree in {enclosing.path if enclosing else 'an unknown cgroup'}"
        self._stopped_by: str | None = None
        self._kills_before = self._kills()
        self.started_at = time.time()
        self.proc = subprocess.Popen(
            launch.argv,
            cwd=launch.cwd,
            env=launch.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.pid: int | None = self.proc.pid
        self._out = LineCapture(self.proc.stdout, launch.stdout_path, "stdout", launch.on_line)
        self._err = LineCapture(self.proc.stderr, launch.stderr_path, "stderr", launch.on_line)
        self._peak = 0
        self._timeline: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._sample, name=f"watch-{self.pid}", daemon=True)
        self._watch.start()

    def _kills(self) -> int:
        try:
            return self.enclosing.oom_kills() if self.enclosing else 0
        except OSError:
            return 0

    def _kills_after(self, status: int) -> int:
        """The counter as it counts for this job: unchanged unless this job lost a process to SIGKILL."""
        if status in (-signal.SIGKILL, 128 + signal.SIGKILL):
            return self._kills()
        return self._kills_before

    def _sample(self) -> None:
        window, window_start = 0, time.time()
        while not self._stop.wait(POLL_S):
            anon = tree_anon_bytes(self.proc.pid)
            self._peak = max(self._peak, anon)
            window = max(window, anon)
            if time.time() - window_start >= 1.0:
                self._timeline.append((round(time.time() - self.started_at, 3), window, window))
                window, window_start = 0, time.time()

    def wait(self, timeout: float | None = None) -> Outcome | None:
        try:
            status = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        ended_at = time.time()
        # Children may outlive the main process (a compiler's cicc or ptxas); they end with the job.
        self._signal_group(signal.SIGKILL)
        self._stop.set()
        self._watch.join()
        self._out.join(2)
        self._err.join(2)
        return Outcome(
            exit_code=status if status >= 0 else None,
            signal=-status if status < 0 else None,
            oom_kills_before=self._kills_before,
            oom_kills_after=self._kills_after(status),
            oom_at=None,
            peak_bytes=self._peak or None,
            anon_peak_bytes=self._peak or None,
            started_at=self.started_at,
            ended_at=ended_at,
            timeline=self._timeline,
            stopped_by=self._stopped_by,
            stderr_tail=list(self._err.tail),
            where=self.where,
        )

    def stop(self, reason: str) -> None:
        """The whole process tree (the job runs in a session of its own): SIGTERM, then SIGKILL."""
        self._stopped_by = self._stopped_by or reason  # the first reason is why it ended
        self._signal_group(signal.SIGTERM)
        try:
            self.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        self._signal_group(signal.SIGKILL)

    def _signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except ProcessLookupError:  # the group is already empty
            pass


class UnconfinedExecutor:
    name = "unconfined"

    def __init__(self) -> None:
        try:
            self.enclosing: Cgroup | None = current_cgroup()
        except CgroupError:
            self.enclosing = None

    def start(self, launch: Launch) -> UnconfinedAttempt:
        launch.stdout_path.parent.mkdir(parents=True, exist_ok=True)
        return UnconfinedAttempt(launch, self.enclosing)
