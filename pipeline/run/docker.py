"""The Docker executor: each attempt is a sibling container with the step's memory limit.

The container gets ``mem_limit`` = ``memswap_limit`` = the attempt's limit (a
step never swaps), labels naming run, step and attempt, and the run directory
mounted at the same path it has for the orchestrator. Evidence for the verdict,
never Docker's ``OOMKilled`` flag or exit 137 alone (the flag is set when any
process of the container was OOM-killed; 137 is any SIGKILL):

- the container's own cgroup files, read from inside by its PID 1
  (``pipeline.run.container_init``) with the local executor's monitor: the
  OOM-kill counter before and after, the peak, the timeline, and the main
  process's exact wait status;
- the engine's ``oom`` events for the container, subscribed before it starts:
  they stand in for the counter when the in-container report is missing (its
  PID 1 was killed), and can only add kills, never remove them;
- the outputs, judged by the orchestrator as for every executor.

Besides the run directory, a step container sees the pipeline file's folder and the
Hugging Face cache (``$HF_HOME``), at the paths they have for the orchestrator.

The orchestrator may itself run in a container (compose's ``pipeline``
service, with the engine's socket mounted): then mounts are resolved from that
container's own mounts, and the steps join its network and use its image.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator

from pipeline.contract.step import PIPELINE_DIR_ENV, RUN_DIR_ENV
from pipeline.memory import Budget, parse_size, read_meminfo
from pipeline.run.executor import (
    STDERR_TAIL_LINES,
    STOP_GRACE_S,
    ExecutorError,
    Launch,
    LineSink,
    Outcome,
    StepOptions,
    join_while_reading,
)
from pipeline.run.host_gpus import host_gpus
from pipeline.run.layout import attempt_name

try:
    import docker
    import docker.errors
    import requests.exceptions
    from docker.types import DeviceRequest, Mount
except ImportError as exc:  # the `docker` extra: needed to run steps, not to read their options
    _SDK_MISSING: str | None = f"{exc}; install it with `pip install 'eyrie[docker]'`"
else:
    _SDK_MISSING = None

DEFAULT_IMAGE = "eyrie-pipeline:latest"
IMAGE_ENV = "EYRIE_IMAGE"
NETWORK_ENV = "EYRIE_DOCKER_NETWORK"
HF_HOME_ENV = "HF_HOME"
STOP_RESEND_S = 0.5
EVENT_SETTLE_S = 2.0
INIT = ["python3", "-m", "pipeline.run.container_init"]
DEFAULT_SOCKET = "unix:///var/run/docker.sock"
# A Hugging Face token file (compose passes it as a secret): step containers see it too.
HF_TOKEN_PATH_ENV = "HF_TOKEN_PATH"


def step_pids_limit(cpus: int) -> int:
    """The most tasks (processes and threads) a step container may have: a fork bomb stops there.

    A step may run a process per CPU, each with a thread pool per CPU (pyarrow, tokenizers,
    OpenMP): CPUs squared, four times over, and never below 4096.
    """
    return max(4096, 4 * cpus * cpus)


def engine_unreachable(exc: Exception) -> str:
    """Why the engine did not answer, and what to do: the socket may be missing or not ours to use."""
    host = os.environ.get("DOCKER_HOST", DEFAULT_SOCKET)
    sock = Path(host.removeprefix("unix://")) if host.startswith("unix://") else None
    if sock is not None and sock.exists() and not os.access(sock, os.R_OK | os.W_OK):
        owner = sock.stat()
        return (
            f"the Docker engine's socket {sock} is mounted here, but this process (uid {os.getuid()}, "
            f"groups {sorted(os.getgroups())}) may not use it: it belongs to uid {owner.st_uid}, "
            f"gid {owner.st_gid}, mode {owner.st_mode & 0o777:o}. Run with group {owner.st_gid} added "
            f"(docker run --group-add {owner.st_gid}; compose/compose.yaml adds it itself; on a host, "
            "usermod -aG docker USER and log in again)"
        )
    return (
        f"cannot reach the Docker engine ({exc}); start dockerd, or mount its socket "
        "(/var/run/docker.sock) into this container, or set DOCKER_HOST"
    )


# The host's environment is not the container's: only these pass through from the
# orchestrator's own environment (the runner's EYRIE_* and a step's `env:` always do).
_PASS_PREFIXES = ("EYRIE_", "HF_", "HUGGING_FACE_", "TRANSFORMERS_", "TOKENIZERS_", "OPENAI_")
_PASS_NAMES = {"http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"}
# Set by the runner for local steps (its virtual environment first on PATH) or by the
# host's shell; a container has its own.
_HOST_NAMES = {"PATH", "HOME", "HOSTNAME", "PWD", "OLDPWD", "SHELL", "USER", "TMPDIR", "VIRTUAL_ENV"}


def container_env(env: dict[str, str], own: dict[str, str] | None = None) -> dict[str, str]:
    """What a step container gets of a launch's environment.

    Everything the runner or the step set (absent from, or different in, the
    orchestrator's own environment), plus the names the step's tools read; never
    PATH, HOME, VIRTUAL_ENV and the like, which describe the host, not the image.
    """
    own = dict(os.environ) if own is None else own
    return {
        key: value
        for key, value in env.items()
        if key not in _HOST_NAMES
        and (own.get(key) != value or key.startswith(_PASS_PREFIXES) or key in _PASS_NAMES)
    }


class _Lines:
    """Reassembles a container's log chunks into lines: log file, sink, last lines kept."""

    def __init__(self, chunks, log_path: Path, name: str, sink: LineSink | None) -> None:
        self._chunks, self._name, self._sink = chunks, name, sink
        self._log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.tail: list[str] = []
        self._lines = 0
        self._thread = threading.Thread(target=self._pump, name=f"logs-{name}", daemon=True)
        self._thread.start()

    def _emit(self, log, line: str) -> None:
        self._lines += 1
        log.write(line + "\n")
        log.flush()
        self.tail.append(line)
        if len(self.tail) > STDERR_TAIL_LINES:
            del self.tail[0]
        if self._sink is not None:
            self._sink(self._name, line)

    def _pump(self) -> None:
        pending = b""
        with open(self._log_path, "a", encoding="utf-8", errors="replace") as log:
            try:
                for chunk in self._chunks:
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for raw in lines:
                        self._emit(log, raw.decode("utf-8", errors="replace"))
            except docker.errors.APIError as exc:
                # the container went away mid-stream: what was read is kept, and the gap is said
                self._emit(log, f"eyrie: log stream ended early: {exc}")
            if pending:
                self._emit(log, pending.decode("utf-8", errors="replace"))

    def join(self, idle: float) -> None:
        join_while_reading(self._thread, lambda: self._lines, idle)


class _EngineEvents:
    """The engine's ``oom`` and ``die`` events for one container, counted as they arrive."""

    def __init__(self, client: docker.DockerClient, container_id: str) -> None:
        self.ooms: list[float] = []
        self.died = threading.Event()
        self._stream = client.events(
            decode=True, filters={"container": container_id, "event": ["oom", "die"]}
        )
        self._thread = threading.Thread(target=self._read, name="engine-events", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            # Closing the stream ends this iteration (the SDK turns the closed socket into StopIteration).
            for event in self._stream:
                if event.get("Action") == "oom":
                    self.ooms.append(event.get("timeNano", time.time_ns()) / 1e9)
                elif event.get("Action") == "die":
                    self.died.set()
        finally:
            self.died.set()

    def close(self, *, settle: bool = True) -> None:
        # `die` comes after any `oom`: once it is seen, nothing more is pending.
        if settle:
            self.died.wait(EVENT_SETTLE_S)
        self._stream.close()


class DockerAttempt:
    def __init__(self, executor: DockerExecutor, launch: Launch, container, report: Path) -> None:
        self.launch = launch
        self.container = container
        self.where = container.id
        self._executor = executor
        self._report = report
        self._stopped_by: str | None = None
        self._status: dict[str, Any] | None = None
        self._ended = threading.Event()
        self.events = _EngineEvents(executor.client, container.id)
        self.started_at = time.time()
        try:
            container.start()
            container.reload()
            self.pid: int | None = container.attrs["State"].get("Pid") or None
            api = executor.client.api
            self._out = _Lines(
                api.logs(container.id, stdout=True, stderr=False, stream=True, follow=True),
                launch.stdout_path,
                "stdout",
                launch.on_line,
            )
            self._err = _Lines(
                api.logs(container.id, stdout=False, stderr=True, stream=True, follow=True),
                launch.stderr_path,
                "stderr",
                launch.on_line,
            )
        except BaseException:
            self.events.close(settle=False)
            raise
        threading.Thread(target=self._wait_container, name=f"wait-{container.name}", daemon=True).start()

    def _wait_container(self) -> None:
        while True:
            try:
                self._status = self.container.wait()
                break
            except docker.errors.NotFound:
                self._status = {"StatusCode": None}
                break
            except Exception:  # noqa: BLE001 - a read timeout on a long step: wait again
                time.sleep(0.5)
        self._ended.set()

    def wait(self, timeout: float | None = None) -> Outcome | None:
        if not self._ended.wait(timeout):
            return None
        ended_at = time.time()
        self._out.join(idle=5)
        self._err.join(idle=5)
        self.events.close()
        try:
            self.container.remove(force=True)
        except docker.errors.NotFound:
            pass
        return self._outcome(ended_at)

    def _outcome(self, ended_at: float) -> Outcome:
        try:
            facts = json.loads(self._report.read_text(encoding="utf-8"))
            self._report.unlink()
        except (FileNotFoundError, ValueError):
            facts = None
        engine_ooms = len(self.events.ooms)
        first_oom = min(self.events.ooms) if self.events.ooms else None
        if facts is None:
            # PID 1 itself died (killed after the stop grace, or by the OOM killer): only the
            # engine's view is left. Its exit status is PID 1's, a signal when above 128.
            code = (self._status or {}).get("StatusCode")
            return Outcome.unwatched(
                self.started_at,
                exit_code=code if code is not None and code < 128 else None,
                signal=code - 128 if code is not None and code > 128 else None,
                oom_kills_after=min(engine_ooms, 1),  # events are notifications, not kills (below)
                oom_at=first_oom,
                ended_at=ended_at,
                stopped_by=self._stopped_by,
                stderr_tail=list(self._err.tail),
                where=self.where,
            )
        before, after = facts["oom_kills_before"], facts["oom_kills_after"]
        # The engine sends an "oom" event per OOM notification of the cgroup, and one kill can
        # take several (the dying victim's allocations retry): the kernel's counter, read
        # inside, is the number of kills; the events only prove one where it counted none.
        if engine_ooms and after == before:
            after = before + 1
        return Outcome(
            exit_code=facts["exit_code"],
            signal=facts["signal"],
            oom_kills_before=before,
            oom_kills_after=after,
            oom_at=facts["oom_at"] or first_oom,
            peak_bytes=facts["peak_bytes"],
            anon_peak_bytes=facts["anon_peak_bytes"],
            started_at=self.started_at,  # before the container started: its start-up is the step's time too
            ended_at=facts["ended_at"],
            timeline=[tuple(point) for point in facts["timeline"]],
            thrash=facts.get("thrash"),
            stopped_by=self._stopped_by,
            stderr_tail=list(self._err.tail),
            where=self.where,
        )

    def stop(self, reason: str) -> None:
        self._stopped_by = self._stopped_by or reason
        # PID 1 passes SIGTERM to every process. Until its handler is installed (a container
        # still starting) PID 1 ignores the signal, so it is sent again through the grace period.
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline:
            try:
                self.container.kill(signal="SIGTERM")
            except docker.errors.APIError:
                return  # already gone
            if self._ended.wait(STOP_RESEND_S):
                return
        try:
            self.container.kill(signal="SIGKILL")
        except docker.errors.APIError:
            pass


class DockerOptions(StepOptions):
    image: str | None = None
    """The step's image (default: $EYRIE_IMAGE, the runner's own container's, or eyrie-pipeline:latest)."""
    shm_size: Annotated[int, BeforeValidator(parse_size)] | None = None
    """Size of the container's /dev/shm (Docker's default: 64 MiB), e.g. ``16GiB`` for NCCL between
    processes on several GPUs. A tmpfs: what is written there counts against the step's memory limit."""

    def fingerprint(self) -> dict[str, Any]:
        return {"image": self.image}


class DockerExecutor:
    """Runs attempts as sibling containers through the engine's API (``DOCKER_HOST`` or the socket)."""

    name = "docker"
    Options = DockerOptions
    runs_here = False
    admits_by_memory = False
    detached = False

    def __init__(
        self,
        options: DockerOptions | None = None,
        client: docker.DockerClient | None = None,
        image: str | None = None,
    ) -> None:
        """``options``: the pipeline's own; each launch carries them merged with its step's."""
        if _SDK_MISSING is not None:
            raise ExecutorError(f"the docker executor is not available: {_SDK_MISSING}")
        try:
            self.client = client or docker.from_env()
            self.client.ping()
        except docker.errors.DockerException as exc:
            raise ExecutorError(engine_unreachable(exc)) from None
        self._own = self._own_container()
        own_image = self._own.image.id if self._own is not None else None
        # for steps whose options (the pipeline's `docker:` or their own) name no image
        self.image = image or os.environ.get(IMAGE_ENV) or own_image or DEFAULT_IMAGE

    def _own_container(self):
        """The container this process runs in, when it runs in one the engine knows."""
        if not Path("/.dockerenv").exists():
            return None
        try:
            return self.client.containers.get(socket.gethostname())
        except docker.errors.APIError:
            return None

    # -- mounts and network --------------------------------------------------------------
    def _mount_for(self, path: Path, *, read_only: bool, required: bool) -> Mount | None:
        """A mount that shows ``path`` in a step container at the same path as here."""
        if self._own is None:
            return Mount(target=str(path), source=str(path), type="bind", read_only=read_only)
        best = None
        for mount in self._own.attrs.get("Mounts", []):
            dest = Path(mount["Destination"])
            if (path == dest or dest in path.parents) and (
                best is None or len(dest.parts) > len(Path(best["Destination"]).parts)
            ):
                best = mount
        if best is None:
            if required:
                raise ExecutorError(
                    f"{path} is not on a volume or bind mount of this container, so step containers "
                    "cannot see it; put the run directory on a volume (compose: the `runs` volume)"
                )
            return None  # inside this container's image: the step image has it too
        source = best["Name"] if best["Type"] == "volume" else best["Source"]
        return Mount(target=best["Destination"], source=source, type=best["Type"], read_only=read_only)

    def _network(self) -> str | None:
        if os.environ.get(NETWORK_ENV):
            return os.environ[NETWORK_ENV]
        if self._own is None:
            return None
        networks = self._own.attrs["NetworkSettings"]["Networks"]
        return next(iter(networks), None)

    def memory_budget(self, options: StepOptions | None = None) -> Budget:
        """What the step containers share: the engine host's MemAvailable.

        They run in the engine's cgroups, not under this process's (in the compose
        ``pipeline`` service, the orchestrator's own limit is for the orchestrator alone).
        ``/proc/meminfo`` shows the host's figures inside a container too.
        """
        meminfo = read_meminfo()
        available = meminfo.get("MemAvailable", meminfo.get("MemFree", 0))
        return Budget(
            available=available,
            mem_total=meminfo.get("MemTotal", 0),
            mem_available=available,
            cgroup_version=None,
            binding="MemAvailable of the Docker host",
        )

    host_memory = memory_budget  # not this process's: in compose its container's limit is its own

    @staticmethod
    def gpu_capacity(options: StepOptions | None = None) -> tuple[int, str]:
        """The containers share the Docker host's GPUs (sysfs shows the host's inside a container too)."""
        return host_gpus(), "the Docker host has (its PCI bus)"

    def service_host(self, handle: DockerAttempt) -> str:
        """A replica is a sibling container: by its name where this runner is a container on the
        same network (the engine's DNS answers there), else by its address on that network, which
        the host and the other containers reach alike."""
        network = self._network()
        if self._own is not None and network:
            return handle.container.name
        handle.container.reload()
        networks = handle.container.attrs["NetworkSettings"]["Networks"]
        found = networks.get(network) if network else next(iter(networks.values()), None)
        if not found or not found.get("IPAddress"):
            raise ExecutorError(f"{handle.container.name} has no address on {network or 'any network'}")
        return found["IPAddress"]

    # -- executor interface --------------------------------------------------------------
    def start(self, launch: Launch) -> DockerAttempt:
        try:
            return self._start(launch)
        except (docker.errors.DockerException, requests.exceptions.ConnectionError) as exc:
            engine_says = getattr(exc, "explanation", None) or str(exc)
            network = self._network()
            checks = ["the image", f"the network {network}" if network else "the network"]
            if launch.gpus:
                checks.append("the NVIDIA Container Toolkit (the step asks for GPUs)")
            raise ExecutorError(
                f"step {launch.step}: Docker could not start its container: {engine_says} "
                f"(check {', '.join(checks)})"
            ) from None

    def _start(self, launch: Launch) -> DockerAttempt:
        options = launch.options if isinstance(launch.options, DockerOptions) else DockerOptions()
        image = options.image or self.image
        try:
            self.client.images.get(image)
        except docker.errors.ImageNotFound:
            raise ExecutorError(
                f"step {launch.step}: image {image!r} is not on this Docker engine; "
                "build it with `make images` (or `make images base=local`)"
            ) from None
        run_dir = Path(launch.env.get(RUN_DIR_ENV) or launch.cwd.parent).resolve()
        os.makedirs(launch.cwd, exist_ok=True)
        launch.stdout_path.parent.mkdir(parents=True, exist_ok=True)
        report = launch.stderr_path.with_name(f"attempt-{launch.attempt}.container.json")
        report.unlink(missing_ok=True)
        if run_dir not in report.parents:
            raise ExecutorError(f"the attempt's log folder {report.parent} is not inside {run_dir}")

        mounts = [self._mount_for(run_dir, read_only=False, required=True)]
        pipeline_dir = launch.env.get(PIPELINE_DIR_ENV)
        if pipeline_dir and run_dir not in Path(pipeline_dir).resolve().parents:
            mounts.append(self._mount_for(Path(pipeline_dir).resolve(), read_only=True, required=False))
        if launch.env.get(HF_HOME_ENV):
            # A target named by hub id is read from the cache once, by every step (compose: the
            # models volume SGLang downloads it into).
            mounts.append(self._mount_for(Path(launch.env[HF_HOME_ENV]), read_only=False, required=False))
        token_file = launch.env.get(HF_TOKEN_PATH_ENV)
        if token_file and Path(token_file).exists():
            mounts.append(self._mount_for(Path(token_file), read_only=True, required=False))
        unique = {m["Target"]: m for m in mounts if m is not None}

        device_requests = [DeviceRequest(count=launch.gpus, capabilities=[["gpu"]])] if launch.gpus else None
        name = attempt_name(launch.run_id, launch.step, launch.attempt)
        stale = self.client.containers.list(all=True, filters={"name": f"^/{name}$"})
        for container in stale:  # left by a runner that died with the same run id
            container.remove(force=True)
        container = self.client.containers.create(
            image,
            entrypoint=[*INIT, str(report), "--"],
            command=list(launch.argv),
            name=name,
            working_dir=str(launch.cwd),
            environment=container_env(launch.env),
            user=f"{os.getuid()}:{os.getgid()}",  # files in the run dir belong to the runner's user
            mem_limit=launch.limit_bytes,
            memswap_limit=launch.limit_bytes,
            # A step runs as the runner's user and needs no capability, nor a setuid program's.
            cap_drop=["ALL"],
            security_opt=["no-new-privileges:true"],
            pids_limit=step_pids_limit(len(os.sched_getaffinity(0))),
            shm_size=options.shm_size,
            labels={
                "eyrie.run": launch.run_id,
                "eyrie.step": launch.step,
                "eyrie.attempt": str(launch.attempt),
            },
            mounts=list(unique.values()),
            network=self._network(),
            device_requests=device_requests,
            stdin_open=False,
            tty=False,
            detach=True,
        )
        try:
            return DockerAttempt(self, launch, container, report)
        except BaseException:
            with contextlib.suppress(docker.errors.DockerException):
                container.remove(force=True)
            raise

    def preflight(self, run_dir: Path, options: dict[str, StepOptions]) -> None:
        return None  # nothing to check before a step starts

    def resume(self, where: str, launch: Launch) -> None:
        """A container whose runner died has lost its evidence reader: it is reaped."""
        return None

    def reap(self, where: str, pid: int | None, started_at: float) -> int:
        # The container id is the attempt's identity; its pid is in the Docker host's namespace.
        try:
            container = self.client.containers.get(where)
        except docker.errors.NotFound:
            return 0
        running = container.status == "running"
        container.remove(force=True)
        return 1 if running else 0
