"""A test stand-in for the in-job wrapper (``pipeline.run.container_init``), for jobs a test runs as
processes of this host: the real one signals and kills every other process of its cgroup, which
here is the test's own.

Run as ``python fake_job_wrapper.py REPORT -- ARGV…``: it runs the step, passes SIGTERM on to it,
and writes the report the real one writes, with the OOM-kill counter read before and after from a
file (``$FAKE_OOM_KILLS``) that a step raises as the kernel raises a cgroup's ``oom_kill``; no peak
and no timeline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def oom_kills() -> int:
    try:
        return int(Path(os.environ["FAKE_OOM_KILLS"]).read_text())
    except (KeyError, FileNotFoundError, ValueError):
        return 0


def main() -> int:
    report, separator, *argv = sys.argv[1:]
    assert separator == "--", sys.argv
    stop: list[int] = []
    step: subprocess.Popen | None = None

    def forward(signum: int, _frame: object) -> None:
        stop.append(signum)
        if step is not None:
            step.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    before, started_at = oom_kills(), time.time()
    step = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    if stop:  # stopped while the step was being started
        step.send_signal(stop[0])
    status = step.wait()
    ended_at, after = time.time(), oom_kills()
    facts = {
        "exit_code": status if status >= 0 else None,
        "signal": -status if status < 0 else None,
        "started_at": started_at,
        "ended_at": ended_at,
        "oom_kills_before": before,
        "oom_kills_after": after,
        "oom_at": ended_at if after > before else None,
        "peak_bytes": None,
        "anon_peak_bytes": None,
        "timeline": [],
        "thrash": None,
    }
    path = Path(report)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(facts), encoding="utf-8")
    os.replace(tmp, path)
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main())
