"""`eyrie serve`: the server command a pipeline's target service runs, checked against SGLang's own
option table (the pinned release's) and `transformers serve`'s flags, and its bad input in one line."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
import yaml
from typer.testing import CliRunner

from eyrie_testing import REPO, docs_page
from pipeline.cli import app
from pipeline.run.spec import load_pipeline
from pipeline.steps.serving.serve_command import ServeConfig, server_command
from tests.unit.accept.test_sglang import _compose_service, _served_argv, parse


def test_sglang_listens_on_every_address_on_the_runners_port_with_the_targets_parsers():
    config = ServeConfig(tp=8, reasoning_parser="kimi_k2", tool_call_parser="kimi_k2", memory_saver=True)
    argv, env = server_command("moonshotai/Kimi-K2.5", 30123, config, trust_remote_code=True)
    args = parse(argv)
    assert (args.model_path, args.port, args.tp_size) == ("moonshotai/Kimi-K2.5", 30123, 8)
    assert args.host == "0.0.0.0"  # reached from its users' containers and nodes
    assert args.trust_remote_code and args.reasoning_parser == args.tool_call_parser == "kimi_k2"
    assert args.enable_memory_saver and args.enable_weights_cpu_backup
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"  # /health must not run the model


def test_transformers_serves_a_model_folder_on_a_cpu(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    argv, env = server_command(str(tmp_path), 30124, ServeConfig(engine="transformers", tp=0), False)
    assert argv[1:3] == ["serve", str(tmp_path)] and argv[argv.index("--port") + 1] == "30124"
    assert argv[argv.index("--host") + 1] == "0.0.0.0" and "--continuous-batching" in argv
    assert env["HF_HUB_OFFLINE"] == "1"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["serve", "Qwen/Qwen3-8B", "--port", "30000", "--tp", "0"], "--tp 0: SGLang spans at least one GPU"),
        (["serve", "/nowhere", "--port", "1", "--engine", "transformers"], "/nowhere: not a model folder"),
        (["serve", "m", "--port", "1", "--engine", "vllm"], "--engine"),
        (["serve", "m", "--port", "1", "--tp", "8", "--sglang-args", "--tp-size 4"], "repeats --tp-size"),
        (["serve", "m", "--port", "1", "--sglang-args", "--port=2 --host ::"], "repeats --host, --port"),
        (
            [
                "serve",
                "/m",
                "--port",
                "1",
                "--engine",
                "transformers",
                "--sglang-args",
                "--kv-cache-dtype bf16",
            ],
            "--sglang-args: the transformers engine",
        ),
    ],
)
def test_what_cannot_be_served_is_one_line(args, says):
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0], result.output


def _docs_glm5_settings() -> dict[str, str]:
    """The settings of the block that runs the real job on GLM-5-NVFP4 (docs/gpu-host.md), as its shell
    reads them."""
    (block,) = [
        b
        for b in re.findall(r"^```[^\n]*\n(.*?)^```", docs_page("gpu-host"), re.S | re.M)
        if "GLM-5-NVFP4" in b and "export EYRIE_TARGET_MODEL=" in b
    ]
    return {
        name: shlex.split(value)[0] for name, value in re.findall(r'^export (\w+)=("[^"]*"|\S+)', block, re.M)
    }


def test_sglangs_own_flags_come_from_one_setting_after_eyries():
    config = ServeConfig(tp=8, sglang_args="--quantization modelopt_fp4  --kv-cache-dtype bf16")
    argv, _ = server_command("m", 30125, config, trust_remote_code=False)
    args = parse(argv)
    assert (args.quantization, args.kv_cache_dtype, args.tp_size) == ("modelopt_fp4", "bf16", 8)
    assert argv[-4:] == ["--quantization", "modelopt_fp4", "--kv-cache-dtype", "bf16"]
    assert (
        server_command("m", 1, ServeConfig(tp=1), False)[0]
        == server_command("m", 1, ServeConfig(tp=1, sglang_args="  "), False)[0]
    )  # empty: nothing passed


@pytest.mark.parametrize(
    "flags", ["--quantisation modelopt_fp4", "--kv-cache-dtype fp16", "--speculative-num-steps three"]
)
def test_a_flag_the_pinned_release_would_refuse_is_caught(flags):
    argv, _ = server_command("m", 1, ServeConfig(tp=1, sglang_args=flags), False)
    with pytest.raises(AssertionError, match="would refuse"):
        parse(argv)


def test_the_docs_serve_glm5_nvfp4_as_its_users_do():
    """The documented GLM-5-NVFP4 block: its flags are ones the pinned release has, with the values its
    users give them on sm_120 (an FP8 KV cache there produces garbage), and its MTP head."""
    shell = _docs_glm5_settings()
    config = ServeConfig(
        tp=8,
        reasoning_parser=shell["EYRIE_REASONING_PARSER"],
        tool_call_parser=shell["EYRIE_TOOL_CALL_PARSER"],
        sglang_args=shell["EYRIE_SGLANG_ARGS"],
    )
    args = parse(server_command(shell["EYRIE_TARGET_MODEL"], 30126, config, trust_remote_code=False)[0])
    assert "GLM-5-NVFP4" in args.model_path
    assert args.quantization == "modelopt_fp4" and args.kv_cache_dtype == "bf16"
    assert args.speculative_algorithm == "EAGLE" and args.speculative_num_steps >= 1
    assert shell["SGLANG_ENABLE_SPEC_V2"] == "True"
    assert shell["EYRIE_TARGET_PLACEMENT"] == "sharded" and shell["EYRIE_TRAIN_PROCESSES"] == "1"


def test_the_pipelines_target_service_passes_the_setting():
    pipeline = REPO / "pipeline" / "jobs" / "eagle3.yaml"
    for environ, given in (
        ({}, ""),
        ({"EYRIE_SGLANG_ARGS": "--kv-cache-dtype bf16"}, "--kv-cache-dtype bf16"),
    ):
        (service,) = load_pipeline(pipeline, environ).services
        assert service.command[service.command.index("--sglang-args") + 1] == given
    assert "EYRIE_SGLANG_ARGS      (empty: none)" in pipeline.read_text()  # documented with its default


def test_composes_sglang_service_appends_the_setting_split_at_spaces(tmp_path):
    """compose.yaml's sglang entrypoint, run by the shell as the container runs it (with a fake
    ``python3`` that prints its arguments): the setting's words after the other flags, unglobbed."""
    sglang = yaml.safe_load((REPO / "compose" / "compose.yaml").read_text())["services"]["sglang"]
    assert sglang["environment"]["EYRIE_SGLANG_ARGS"] == "${EYRIE_SGLANG_ARGS:-}"
    assert "SGLANG_ENABLE_SPEC_V2" in sglang["environment"]  # passed through when set
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    fake.chmod(0o755)
    (tmp_path / "glm5").touch()  # what a glob in the setting would become
    entrypoint = [arg.replace("$$", "$") for arg in sglang["entrypoint"]]
    setting = "--quantization modelopt_fp4  --kv-cache-dtype bf16 --served-model-name glm*"
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "EYRIE_SGLANG_ARGS": setting}
    done = subprocess.run(
        [*entrypoint, "--model-path", "m"], capture_output=True, text=True, env=env, cwd=tmp_path, check=True
    )
    argv = [sys.executable, *done.stdout.splitlines()]
    assert argv[-6:] == setting.split()
    args = parse(argv)
    assert (args.quantization, args.kv_cache_dtype, args.served_model_name) == (
        "modelopt_fp4",
        "bf16",
        "glm*",
    )


def test_the_compose_server_serves_glm5_nvfp4(tmp_path):
    """The documented GLM-5-NVFP4 block through compose: its flags reach SGLang, its MTP switch too."""
    shell = _docs_glm5_settings()
    service = _compose_service("sglang", shell)
    args = parse(_served_argv(service, tmp_path))
    assert args.quantization == "modelopt_fp4" and args.kv_cache_dtype == "bf16"
    assert args.enable_memory_saver and args.tp_size == 8
    assert service["environment"]["SGLANG_ENABLE_SPEC_V2"] == "True"
