"""The container init: the step's parent inside a container (its PID 1) or a Slurm job; runs the
step, reports its cgroup.

``python3 -m pipeline.run.container_init REPORT -- ARGV...``

Docker removes a container's cgroup when its last process exits, and Slurm a
job's when the job ends, so the OOM-kill counter and the peak can only be read
from inside, while something still lives there. This process starts the step,
watches its own cgroup (the container's; the job's task cgroup) with the same
monitor the local executor uses, and once the step's main process has ended
(and its leftovers are killed, as the local executor kills them) writes the
evidence to REPORT as JSON: the exact wait status (exit code or signal, not the
shell's 128+N), the counter before and after, the peak and the timeline.

It reaps every orphan (as PID 1, or as the children's subreaper in a job), and
passes SIGTERM/SIGINT on to every process of its cgroup, as the local executor
signals every process of a step's cgroup.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.contract.exits import EXIT_BAD_INPUT
from pipeline.memory import Cgroup, CgroupError, current_cgroup
from pipeline.run.executor import STOP_GRACE_S
from pipeline.run.monitor import CgroupMonitor

PR_SET_CHILD_SUBREAPER = 36  # prctl(2): orphaned descendants are re-parented to this process


def _become_subreaper() -> None:
    """Outside a container (a Slurm job) orphans would go to the host's init: keep them here."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux's libc: orphans are still killed through the cgroup, only reaped elsewhere


def _others(cgroup: Cgroup) -> list[int]:
    me = os.getpid()
    return [pid for pid in cgroup.procs() if pid not in (me, 0)]


def _signal_all(cgroup: Cgroup, sig: int) -> None:
    for pid in _others(cgroup):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _reap_nohang() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _wait_main(main_pid: int) -> int:
    """Reap children until the main process ends; its raw wait status."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except InterruptedError:
            continue
        if pid == main_pid:
            return status


def run(report_path: Path, argv: list[str]) -> int:
    _become_subreaper()
    cgroup = current_cgroup()
    monitor = CgroupMonitor(cgroup, on_thrash=lambda: _signal_all(cgroup, signal.SIGKILL))

    stop_signal: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if stop_signal:
            return  # passed on once, as the local executor signals a step once; repeats are resends
        stop_signal.append(signum)
        _signal_all(cgroup, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    started_at = time.time()
    monitor.start()
    if stop_signal:
        # Stopped before the step began: it ends as a step stopped by that signal would.
        status = stop_signal[0]
    else:
        try:
            main = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        except OSError as exc:
            print(f"eyrie: cannot start {argv[0]!r}: {exc.strerror}", file=sys.stderr)
            monitor.finish()
            return 127
        status = _wait_main(main.pid)
        main.returncode = 0  # reaped above; keeps Popen from waiting on a pid that is gone
    ended_at = time.time()

    # Children may outlive the main process; they belong to the attempt and end with it.
    if _others(cgroup):
        _signal_all(cgroup, signal.SIGKILL)
        deadline = time.monotonic() + STOP_GRACE_S
        while _others(cgroup) and time.monotonic() < deadline:
            _reap_nohang()
            time.sleep(0.05)
    _reap_nohang()
    facts = monitor.finish()

    exit_code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    report = {
        "exit_code": exit_code,
        "signal": sig,
        "started_at": started_at,
        "ended_at": ended_at,
        "cgroup": str(cgroup.path),
        "cgroup_version": cgroup.version,
        "oom_kills_before": facts.oom_kills_before,
        "oom_kills_after": facts.oom_kills_after,
        "oom_at": facts.oom_at,
        "peak_bytes": facts.peak_bytes,
        "anon_peak_bytes": facts.anon_peak_bytes,
        "timeline": facts.timeline,
        "thrash": facts.thrash,
    }
    tmp = report_path.with_name(f".{report_path.name}.tmp")
    tmp.write_text(json.dumps(report), encoding="utf-8")
    os.replace(tmp, report_path)
    return exit_code if exit_code is not None else 128 + (sig or 0)


def main() -> int:
    args = sys.argv[1:]
    if len(args) < 3 or args[1] != "--":
        print("usage: python3 -m pipeline.run.container_init REPORT -- ARGV...", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return run(Path(args[0]), args[2:])
    except CgroupError as exc:
        print(f"eyrie: {exc}", file=sys.stderr)
        return 125


if __name__ == "__main__":
    sys.exit(main())
