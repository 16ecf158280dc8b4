"""A container the engine refuses to start: one error naming the step, nothing left behind."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest

docker_errors = pytest.importorskip("docker.errors")  # the `docker` extra

from pipeline.contract.step import RUN_DIR_ENV  # noqa: E402
from pipeline.run import docker as docker_executor  # noqa: E402
from pipeline.run.executor import ExecutorError, Launch  # noqa: E402

NO_GPU_RUNTIME = 'could not select device driver "" with capabilities: [[gpu]]'


class FakeEventStream:
    def __init__(self) -> None:
        self.closed = threading.Event()

    def __iter__(self):
        self.closed.wait()  # like the engine's stream: nothing until closed
        return iter(())

    def close(self) -> None:
        self.closed.set()


class FakeContainer:
    id = "c0ffee"
    name = "eyrie-r1-train-1"

    def __init__(self, start_error: Exception | None) -> None:
        self.start_error = start_error
        self.removed = False

    def start(self) -> None:
        if self.start_error is not None:
            raise self.start_error

    def remove(self, force: bool = False) -> None:
        self.removed = True


class FakeContainers:
    def __init__(self, create_error: Exception | None, start_error: Exception | None) -> None:
        self.create_error = create_error
        self.made = FakeContainer(start_error)

    def get(self, name: str):
        raise docker_errors.NotFound(f"no container {name}")

    def list(self, **filters):
        return []

    def create(self, image: str, **options) -> FakeContainer:
        if self.create_error is not None:
            raise self.create_error
        self.options = options
        return self.made


class FakeClient:
    def __init__(
        self, *, create_error: Exception | None = None, start_error: Exception | None = None
    ) -> None:
        self.containers = FakeContainers(create_error, start_error)
        self.images = self
        self.streams: list[FakeEventStream] = []

    def ping(self) -> bool:
        return True

    def get(self, image: str) -> object:  # images.get
        return object()

    def events(self, **filters) -> FakeEventStream:
        self.streams.append(FakeEventStream())
        return self.streams[-1]


def launch(tmp_path: Path) -> Launch:
    run_dir = tmp_path / "run"
    logs = run_dir / ".eyrie" / "logs" / "train"
    return Launch(
        run_id="r1",
        step="train",
        attempt=1,
        argv=["eyrie", "train"],
        cwd=run_dir / "train",
        env={RUN_DIR_ENV: str(run_dir)},
        limit_bytes=2**30,
        stdout_path=logs / "attempt-1.stdout.log",
        stderr_path=logs / "attempt-1.stderr.log",
        gpus=1,
        options=docker_executor.DockerOptions(image="eyrie-pipeline:test"),
    )


def test_a_container_the_engine_cannot_start_is_one_error_and_is_removed(tmp_path):
    refused = docker_errors.APIError("500 Server Error: Internal Server Error", explanation=NO_GPU_RUNTIME)
    client = FakeClient(start_error=refused)
    executor = docker_executor.DockerExecutor(client=client)
    with pytest.raises(ExecutorError) as info:
        executor.start(launch(tmp_path))
    message = str(info.value)
    assert message.startswith("step train:") and NO_GPU_RUNTIME in message and "\n" not in message
    assert "NVIDIA Container Toolkit" in message  # it asked for GPUs
    assert client.containers.made.removed
    assert all(stream.closed.is_set() for stream in client.streams) and client.streams


def test_a_container_the_engine_cannot_create_is_one_error(tmp_path):
    refused = docker_errors.NotFound("404 Client Error", explanation="network eyrie_nope not found")
    executor = docker_executor.DockerExecutor(client=FakeClient(create_error=refused))
    with pytest.raises(ExecutorError, match="step train: .*network eyrie_nope not found"):
        executor.start(launch(tmp_path))


def test_the_steps_shared_memory_size_reaches_the_container(tmp_path):
    """What the engine is asked to create (a container started for real: tests/integration/test_docker.py)."""
    refused = docker_errors.APIError("stop here: the options are what this test reads")
    client = FakeClient(start_error=refused)
    executor = docker_executor.DockerExecutor(client=client)
    options = docker_executor.DockerOptions.model_validate(
        {"image": "eyrie-pipeline:test", "shm_size": "16GiB"}
    )
    with pytest.raises(ExecutorError):
        executor.start(replace(launch(tmp_path), options=options))
    assert client.containers.options["shm_size"] == 16 * 2**30
    with pytest.raises(ExecutorError):
        executor.start(launch(tmp_path))
    assert client.containers.options["shm_size"] is None  # Docker's default
