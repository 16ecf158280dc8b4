"""Whether a process lives, and whether the runner of a run still does.

A pid alone says little: once a process ends, Linux may give its pid to another. A process is the
one recorded only if it began before the moment it was recorded at (``/proc/PID/stat``'s start
time). On another host nothing can be looked up: there a runner's signs of life in the ledger (a
host sample or a heartbeat, once a second) tell, and ``RUNNER_GONE_S`` without one means gone.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

from pipeline.run.host_sampler import SAMPLE_S
from pipeline.run.ledger import Ledger, RunState

RUNNER_GONE_S = 15.0  # no host sample nor heartbeat (one a second) for this long: the runner is gone
START_SLACK_S = 2.0  # /proc/stat's btime is whole seconds: a start time read from it may be late by this


def proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rindex(")") + 2 :].split()


def alive(pid: int) -> bool:
    fields = proc_stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")  # a zombie holds nothing but its pid


def started_at(pid: int) -> float | None:
    """When process ``pid`` began (unix time, to ``START_SLACK_S``), or None if it is gone."""
    fields = proc_stat(pid)
    if fields is None:
        return None
    stat = Path("/proc/stat").read_text().splitlines()
    boot = next(int(line.split()[1]) for line in stat if line.startswith("btime "))
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime: ticks since boot


def runner_alive_here(run: dict[str, Any]) -> bool:
    """Whether the runner of ``run`` still runs on this host: its recorded pid lives and began
    before the run was recorded (a later process given the same pid is another)."""
    if run["host"] != socket.gethostname() or not alive(run["orchestrator_pid"]):
        return False
    began = started_at(run["orchestrator_pid"])
    return began is not None and began <= run["started_at"] + START_SLACK_S


def runner_gone(ledger: Ledger, run: dict[str, Any], now: float | None = None) -> float | None:
    """For a run the ledger holds as running whose runner is gone, when it was last seen; None while
    it runs or once the run ended. On this host the pid tells, once a sign of life is overdue (a
    runner in another pid namespace under the same host name goes on writing them); elsewhere
    ``RUNNER_GONE_S`` without one."""
    if run["state"] != RunState.RUNNING:
        return None
    now = time.time() if now is None else now
    seen = ledger.last_seen(run["run_id"]) or run["started_at"]
    here = run["host"] == socket.gethostname()
    if now - seen <= (2 * SAMPLE_S if here else RUNNER_GONE_S) or (here and runner_alive_here(run)):
        return None
    return seen
