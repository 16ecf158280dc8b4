"""The local reaper where an attempt's cgroup is gone: the recorded process and its group, if it is
still the process the attempt started."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from pipeline.memory import current_cgroup
from pipeline.run.local import LocalExecutor


def executor() -> LocalExecutor:
    return LocalExecutor(parent=current_cgroup())  # nothing is created: the reaper only reads here


def gone(pid: int) -> bool:
    for _ in range(50):
        try:
            os.waitpid(pid, os.WNOHANG)
            os.kill(pid, 0)
        except (ChildProcessError, ProcessLookupError):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def step():
    """A step as the runner starts one: a session of its own, with a child in its process group."""
    began = time.time()
    proc = subprocess.Popen(["sh", "-c", "sleep 600 & wait"], start_new_session=True)
    time.sleep(0.3)
    yield proc, began
    proc.kill()
    proc.wait()


def test_the_recorded_process_and_its_group_are_killed_when_the_cgroup_is_gone(step):
    proc, began = step
    (child,) = map(int, open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split())
    assert executor().reap("/sys/fs/cgroup/memory/no/such/cgroup", proc.pid, began) == 2
    assert gone(proc.pid) and gone(child)


def test_a_pid_that_started_long_after_the_attempt_is_another_process(step):
    proc, began = step
    assert executor().reap("/sys/fs/cgroup/memory/no/such/cgroup", proc.pid, began - 3600) == 0
    os.kill(proc.pid, 0)  # left alone


def test_no_cgroup_above_the_runner_is_ever_taken_for_a_step(step):
    proc, began = step
    own = current_cgroup()
    for ancestor in own.ancestors():  # a ledger naming one of them must not kill this process
        assert executor()._recorded_cgroup(str(ancestor.path)) is None


def test_the_group_is_killed_when_the_recorded_process_itself_has_died(step):
    proc, began = step
    (child,) = map(int, open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split())
    proc.kill()  # the main process is gone; its child lives on in its process group
    proc.wait()
    assert executor().reap("/sys/fs/cgroup/memory/no/such/cgroup", proc.pid, began) == 1
    assert gone(child)
