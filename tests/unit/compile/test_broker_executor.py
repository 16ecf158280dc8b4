"""The build takes the executor its jobs run under by name, from the registry the runner uses."""

from __future__ import annotations

import pytest

from pipeline.compile.broker import BuildBroker
from pipeline.compile.profile import Profile
from pipeline.run import EXECUTORS
from pipeline.run.executor import ExecutorError
from pipeline.run.local import LocalExecutor

GiB = 2**30


class RecordingExecutor(LocalExecutor):
    """The local executor under another registered name, remembering the parent cgroup it was given."""

    name = "recording"
    parents: list = []

    def __init__(self, options=None, parent=None) -> None:
        super().__init__(options, parent)
        RecordingExecutor.parents.append(parent)


def broker(tmp_path, executor: str) -> BuildBroker:
    return BuildBroker(
        nvcc="nvcc",
        nvcc_version="13.0",
        package="flash-attn 2.8.3",
        budget=GiB,
        cpu_slots=1,
        profile=Profile([], default_peak=GiB),
        run_dir=tmp_path,
        executor=executor,
    )


def test_an_unknown_executor_is_refused_naming_the_known_ones(tmp_path) -> None:
    with pytest.raises(ExecutorError, match=r"--executor 'nowhere': unknown executor; choose one of local, "):
        broker(tmp_path, "nowhere")


def test_jobs_run_under_the_executor_registered_by_that_name(tmp_path, monkeypatch, real_cgroups) -> None:
    monkeypatch.setitem(EXECUTORS, "recording", f"{__name__}:RecordingExecutor")
    with broker(tmp_path, "recording") as build:
        assert isinstance(build.executor, RecordingExecutor)
        assert RecordingExecutor.parents == [build.cgroup]  # each job's cgroup goes under the build's own
        assert build.cgroup.limit() == GiB
