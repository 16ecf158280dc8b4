"""`eyrie serve`: the server command a pipeline's target service runs, checked against SGLang's own
option table (the pinned release's) and `transformers serve`'s flags, and its bad input in one line."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.steps.target_server import ServeConfig, server_command
from tests.unit.accept.test_sglang import parse


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
    ],
)
def test_what_cannot_be_served_is_one_line(args, says):
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0], result.output
