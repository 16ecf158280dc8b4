"""The SGLang command lines eyrie writes, parsed with the option table of the release the image pins.

The table (tests/fixtures/sglang/) was read from that release's own ``server_args.py``
by ``tests/fixtures/sglang/extract_flags.py``; a test below keeps it the image's version.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys

import pytest

from eyrie_testing import REPO, docs_page
from pipeline.memory.units import parse_size
from pipeline.steps.serving.sglang import Parsers, Speculation, server_argv

SGLANG_DOCKERFILE = REPO / "images" / "sglang" / "Dockerfile"
TABLES = REPO / "tests" / "fixtures" / "sglang"
TYPES = {"int": int, "float": float}


def pinned_version() -> str:
    match = re.search(r"^ARG BASE=lmsysorg/sglang:v([0-9.]+)-", SGLANG_DOCKERFILE.read_text(), re.M)
    assert match, "images/sglang/Dockerfile pins no lmsysorg/sglang release"
    return match.group(1)


def sglang_parser() -> argparse.ArgumentParser:
    """SGLang's own options (those of the pinned release), each with its action, type and choices."""
    table = json.loads((TABLES / f"server_args-v{pinned_version()}.json").read_text())
    parser = argparse.ArgumentParser(prog="sglang.launch_server", allow_abbrev=False, exit_on_error=False)
    for flag, option in table["options"].items():
        if option["action"] == "store_true":
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=TYPES.get(option["type"], str), choices=option["choices"])
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    try:
        return sglang_parser().parse_args(argv[3:])
    except (argparse.ArgumentError, SystemExit) as exc:
        raise AssertionError(f"SGLang v{pinned_version()} would refuse {argv[3:]}: {exc}") from None


def test_the_option_table_is_the_pinned_release():
    assert (TABLES / f"server_args-v{pinned_version()}.json").is_file()


def test_target_with_an_eagle3_draft(tmp_path):
    speculation = Speculation(tmp_path / "draft", num_steps=5, topk=4, num_draft_tokens=16)
    argv = server_argv("Qwen/Qwen3-8B", port=30001, tp=8, trust_remote_code=True, speculation=speculation)
    args = parse(argv)
    assert args.model_path == "Qwen/Qwen3-8B" and args.tp_size == 8 and args.port == 30001
    assert args.trust_remote_code is True
    assert args.speculative_algorithm == "EAGLE3"
    assert args.speculative_draft_model_path == str(tmp_path / "draft")
    speculative = (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens)
    assert speculative == (5, 4, 16)


def test_the_same_server_without_speculation():
    args = parse(server_argv("/models/kimi", port=30002, tp=8))
    assert args.speculative_algorithm is None and args.speculative_draft_model_path is None
    assert args.trust_remote_code is False and args.host == "127.0.0.1"
    assert args.reasoning_parser is None and args.tool_call_parser is None


# Kimi-K2.5 thinks in <think>...</think> and calls tools in <|tool_calls_section_begin|> sections:
# SGLang v0.5.12's KimiK2Detector of each (parser/reasoning_parser.py, function_call/kimik2_detector.py).
KIMI_K25_PARSERS = Parsers(reasoning="kimi_k2", tool_call="kimi_k2")


def test_kimi_k25_is_served_with_its_parsers():
    args = parse(
        server_argv(
            "moonshotai/Kimi-K2.5", port=30003, tp=8, trust_remote_code=True, parsers=KIMI_K25_PARSERS
        )
    )
    assert (args.reasoning_parser, args.tool_call_parser) == ("kimi_k2", "kimi_k2")
    assert args.trust_remote_code is True


def test_a_parser_the_release_lacks_is_caught():
    """The parsers' names are checked against the release's own (its choices, read from the source)."""
    with pytest.raises(AssertionError, match="would refuse"):
        parse(server_argv("m", port=1, tp=1, parsers=Parsers(reasoning="kimi-k2.5")))
    with pytest.raises(AssertionError, match="would refuse"):
        parse(server_argv("m", port=1, tp=1, parsers=Parsers(tool_call="kimi_k25")))


def test_a_flag_the_release_lacks_is_caught():
    argv = server_argv("m", port=1, tp=1)
    with pytest.raises(AssertionError, match="would refuse"):
        parse([*argv, "--speculative-eagle-top-k", "4"])


def _compose_service(name: str, environ: dict[str, str] | None = None) -> dict:
    """compose.yaml's service as compose resolves it (settings from ``environ``, else their defaults)."""
    if shutil.which("docker") is None:
        pytest.skip("the docker command line is not installed")
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", **(environ or {})}
    result = subprocess.run(
        ["docker", "compose", "-f", "compose/compose.yaml", "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
    )
    if "is not a docker command" in result.stderr:
        pytest.skip("the Compose v2 plugin is not installed")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["services"][name]


def _served_argv(service: dict, tmp_path) -> list[str]:
    """What the service's entrypoint runs, found by running it with a test fake ``python3`` first on
    PATH that prints its arguments (the image's SGLang cannot run here)."""
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    fake.chmod(0o755)
    # compose's config output keeps its $$ escapes; the container's shell sees single $.
    argv = [arg.replace("$$", "$") for arg in [*service["entrypoint"], *service["command"]]]
    # A name passed through unset (null) is not in the container's environment.
    env = {
        **{k: v for k, v in service["environment"].items() if v is not None},
        "PATH": f"{fake.parent}:/usr/bin:/bin",
    }
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=True)
    return [sys.executable, *done.stdout.splitlines()]


def test_the_compose_servers_flags(tmp_path):
    """compose.yaml's sglang service: what SGLang gets, with the file's defaults and with settings."""
    args = parse(_served_argv(_compose_service("sglang"), tmp_path))
    assert args.enable_memory_saver is True and args.tp_size == 8 and args.model_path == "Qwen/Qwen3-8B"
    # Released weights are kept in host memory, or a resumed server would compute with garbage.
    assert args.enable_weights_cpu_backup is True and args.trust_remote_code is False
    shell = {"EYRIE_TRUST_REMOTE_CODE": "1", "EYRIE_SGLANG_WEIGHTS_BACKUP": "0", "EYRIE_GPUS": "4"}
    args = parse(_served_argv(_compose_service("sglang", shell), tmp_path))
    assert args.trust_remote_code is True and args.enable_weights_cpu_backup is False and args.tp_size == 4
    assert parse(
        _served_argv(_compose_service("sglang", {"EYRIE_TRUST_REMOTE_CODE": "True"}), tmp_path)
    ).trust_remote_code
    assert args.reasoning_parser is None and args.tool_call_parser is None  # empty: not passed


def _docs_kimi_k25_settings() -> dict[str, str]:
    """The settings of the block that runs the real job on Kimi-K2.5 (docs/gpu-host.md)."""
    (block,) = [
        b
        for b in re.findall(r"^```[^\n]*\n(.*?)^```", docs_page("gpu-host"), re.S | re.M)
        if "export EYRIE_TARGET_MODEL=moonshotai/Kimi-K2.5" in b
    ]
    return dict(re.findall(r"^export (EYRIE_\w+)=(\S+)", block, re.M))


def test_the_compose_server_serves_kimi_k25(tmp_path):
    """The documented settings for Kimi-K2.5: every flag they give SGLang is one the release has."""
    shell = _docs_kimi_k25_settings()
    assert (shell["EYRIE_REASONING_PARSER"], shell["EYRIE_TOOL_CALL_PARSER"]) == (
        KIMI_K25_PARSERS.reasoning,
        KIMI_K25_PARSERS.tool_call,
    )
    args = parse(_served_argv(_compose_service("sglang", shell), tmp_path))
    assert args.model_path == "moonshotai/Kimi-K2.5" and args.trust_remote_code is True
    assert (args.reasoning_parser, args.tool_call_parser) == ("kimi_k2", "kimi_k2")
    assert args.enable_weights_cpu_backup is False  # the target is larger than the host's memory
    # 594 GB of weights fit no GPU: split over all of them, by one process
    assert shell["EYRIE_TARGET_PLACEMENT"] in ("sharded", "offline") and shell["EYRIE_TRAIN_PROCESSES"] == "1"
    # the server (paused) and train at once, inside the 449 GB of the host the block is for
    service = _compose_service("sglang", shell)
    assert int(service["mem_limit"]) + parse_size(shell["EYRIE_TRAIN_MEMORY"]) <= 449 * 10**9


# SGLang v0.5.12 (entrypoints/http_server.py): /health_generate always runs a one-token generation;
# /health does unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is false (environ.py's EnvBool).
_GENERATING_PATHS = {"/health_generate"}
_ENV_BOOL_FALSE = {"false", "0", "no", "n"}


def test_the_compose_health_check_never_runs_the_model():
    """While train or accept hold the GPUs the server's weights are unmapped: a health check that
    generated would bring it down."""
    service = _compose_service("sglang")
    check = " ".join(service["healthcheck"]["test"])
    (url,) = re.findall(r"http://localhost:30000(/\S*)", check)
    assert url not in _GENERATING_PATHS
    if url == "/health":
        generation = service["environment"].get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true")
        assert generation.lower() in _ENV_BOOL_FALSE
