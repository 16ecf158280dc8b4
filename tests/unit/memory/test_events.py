"""The kernel's memory-event notifications: a real v1 eventfd here, inotify on a v2-shaped file."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from pipeline.memory import CgroupV2
from pipeline.memory.events import event_notifier


def test_v2_inotify_wakes_on_a_memory_events_change(tmp_path: Path):
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
    notifier = event_notifier(CgroupV2(tmp_path))
    assert notifier is not None
    try:
        assert notifier.wait(0.05) is False
        writer = threading.Timer(
            0.1, lambda: (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
        )
        start = time.monotonic()
        writer.start()
        assert notifier.wait(5) is True
        assert time.monotonic() - start < 1
    finally:
        notifier.close()


@pytest.mark.usefixtures("real_cgroups")
def test_v1_eventfd_fires_when_the_cgroup_goes_out_of_memory():
    import subprocess
    import sys

    from pipeline.memory import CgroupV1, step_parent

    parent = step_parent()
    if not isinstance(parent, CgroupV1):
        pytest.skip("this host runs cgroup v2")
    cgroup = parent.child(f"events-test-{time.time_ns()}")
    cgroup.create()
    try:
        cgroup.set_limit(48 * 1024 * 1024)
        notifier = event_notifier(cgroup)
        assert notifier is not None
        hog = subprocess.Popen(
            [
                "/bin/sh",
                "-c",
                'echo $$ > "$0" && exec "$@"',
                str(cgroup.path / "cgroup.procs"),
                sys.executable,
                "-c",
                "x = [b'1' * 2**20 for _ in range(200)]",
            ],
        )
        assert notifier.wait(30) is True
        hog.wait(30)
        assert cgroup.oom_kills() >= 1
        notifier.close()
    finally:
        cgroup.kill_all()
        time.sleep(0.2)
        cgroup.remove()
