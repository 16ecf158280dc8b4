"""Each step's options are stated once, in the step's own module, with their defaults from the one
definition the step runs with: a command run with no options hands the step exactly its defaults,
and ``--help`` shows them."""

from __future__ import annotations

import importlib
import inspect

import pytest
import typer
import yaml
from pydantic import BaseModel
from typer.core import TyperGroup
from typer.testing import CliRunner

import pipeline.cli
from pipeline.cli import STEP_COMMANDS, app
from pipeline.steps.accept.config import AcceptConfig
from pipeline.steps.generate.config import GenerateConfig, GenerateSettings
from pipeline.steps.prep.config import PrepConfig
from pipeline.steps.serving.serve_command import ServeConfig
from pipeline.steps.tokenize.config import TokenizeConfig
from pipeline.steps.train import cli as train_cli
from pipeline.steps.train.config import TrainConfig

EYRIE = typer.main.get_command(app)
SETTINGS = {
    "prep": PrepConfig,
    "generate": GenerateSettings,
    "tokenize": TokenizeConfig,
    "train": TrainConfig,
    "accept": AcceptConfig,
    "serve": ServeConfig,
}
"""Each step command's settings model (and the target server's): its options are the model's fields."""


def command(*path: str):
    found = EYRIE
    for name in path:
        assert isinstance(found, TyperGroup)
        found = found.get_command(typer.Context(found), name)
    return found


def every_command(group: TyperGroup = EYRIE, path: tuple[str, ...] = ()):
    ctx = typer.Context(group)
    for name in group.list_commands(ctx):
        sub = group.get_command(ctx, name)
        yield (*path, name), sub
        if isinstance(sub, TyperGroup):
            yield from every_command(sub, (*path, name))


def options(cmd) -> dict:
    return {p.name: p for p in cmd.params}


def implementation(monkeypatch, module: str, name: str) -> tuple[inspect.Signature, list]:
    """Replace ``module.name`` with a recorder; returns its real signature and the calls it gets."""
    real = getattr(importlib.import_module(module), name)
    calls: list[inspect.BoundArguments] = []

    def record(*args, **kwargs):
        calls.append(inspect.signature(real).bind(*args, **kwargs))
        return 0

    monkeypatch.setattr(f"{module}.{name}", record)
    return inspect.signature(real), calls


def invoke(*args: str) -> None:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("name", list(STEP_COMMANDS))
def test_the_top_cli_adds_the_command_its_step_declares(name):
    module = STEP_COMMANDS[name].split(":")[0]
    found = command(name)
    leaves = list(found.commands.values()) if isinstance(found, TyperGroup) else [found]
    assert leaves
    for leaf in leaves:
        assert leaf.callback.__wrapped__.__module__ == module  # the step's function, not a copy
    assert not hasattr(pipeline.cli, name)  # the top CLI declares none of it


def test_no_command_declares_an_option_twice():
    for path, cmd in every_command():
        names = [p.name for p in cmd.params]
        flags = [flag for p in cmd.params for flag in (*p.opts, *p.secondary_opts)]
        assert len(names) == len(set(names)), path
        assert len(flags) == len(set(flags)), path


def test_an_option_whose_default_help_shows_does_not_state_it_again():
    """A default written in the help text is a second statement of it, free to disagree."""
    for path, cmd in every_command():
        for param in cmd.params:
            shown = param.param_type_name == "option" and param.default not in (None, False, ())
            if shown and param.help:
                assert "default" not in param.help.lower(), (path, param.name, param.help)


def settings_fields(model: type[BaseModel]):
    """(name, field) of every setting of ``model``; a group's (a field whose type is a model) in its place."""
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from field.annotation.model_fields.items()
        else:
            yield name, field


def declared_by(path: str) -> set[str]:
    """The options a step's command declares itself (shared ones, its inputs), not its model's."""
    return set(inspect.signature(inspect.unwrap(command(path).callback)).parameters) - {"settings"}


def test_every_step_command_has_a_settings_model():
    assert set(SETTINGS) == set(STEP_COMMANDS) - {"build"}


@pytest.mark.parametrize("step", list(SETTINGS))
def test_every_setting_is_an_option_with_the_fields_default_and_help(step):
    found = options(command(step))
    own = declared_by(step)
    settings = [(name, field) for name, field in settings_fields(SETTINGS[step]) if name not in own]
    assert len(settings) >= 5
    for name, field in settings:
        option = found[name]
        default = None if field.is_required() else field.get_default(call_default_factory=True)
        if isinstance(default, list):
            default = ",".join(map(str, default))
        assert (option.required, option.default) == (field.is_required(), default), (step, name)
        assert field.description and option.help == field.description, (step, name)
    # Every other option is one the command declares itself: nothing is stated in two places.
    assert set(found) - {name for name, _ in settings} == own - {"ctx"}, step


# Each step's flags as they were when every step stated its own: pipelines and scripts use them.
FLAGS = {
    "prep": "--catalog --offline --online --quota --out-dir --seed --workers --worker-memory",
    "generate": "--url --serve --continuous-batching --no-continuous-batching --model --mode --concurrency "
    "--temperature --top-p --max-tokens --seed --chat-template-kwargs --drop-truncated --no-drop-truncated "
    "--retry-errors --no-retry-errors --restart --no-restart --max-retries --retry-base --max-error-rate "
    "--error-window --request-timeout --health-timeout --api-key-env --api-key-file --limit --out-dir",
    "tokenize": "--tokenizer --conversations --tokenized --chat-template --max-length --shard-rows --out-dir "
    "--workers --worker-memory --trust-remote-code",
    "accept": "--draft --target --data --bench --engine --num-steps --topk --num-draft-tokens "
    "--heldout-fraction --max-length --prompts --max-new-tokens --concurrency --tp --startup-timeout "
    "--request-timeout --trust-remote-code --reasoning-parser --tool-call-parser --release-target --out-dir",
}


@pytest.mark.parametrize("step", list(FLAGS))
def test_a_step_keeps_its_flags(step):
    flags = [
        flag
        for p in command(step).params
        if p.param_type_name == "option"
        for flag in (*p.opts, *p.secondary_opts)
    ]
    assert sorted(flags) == sorted(FLAGS[step].split())


def settings_of(train_command: inspect.BoundArguments) -> TrainConfig:
    """The settings a call of ``train_command`` runs with (its file, the options given on top)."""
    return train_cli.load_config(train_command.arguments["config_file"], train_command.arguments["overrides"])


def test_train_with_no_options_runs_the_settings_defaults_and_leaves_the_file_its_say(monkeypatch, tmp_path):
    _, calls = implementation(monkeypatch, "pipeline.steps.train.cli", "train_command")
    invoke("train", "--data", "shards", "--target", "model")
    config = settings_of(calls[0])
    assert config == TrainConfig(data="shards", target="model")

    settings = tmp_path / "train.yaml"
    settings.write_text(yaml.safe_dump({"lr": 0.5, "trust_remote_code": True, "layer_ids": [2, 3, 4]}))
    given = ("train", "--config", str(settings), "--data", "shards", "--target", "model")
    invoke(*given, "--max-steps", "0")
    config = settings_of(calls[1])
    assert (config.lr, config.trust_remote_code, config.layer_ids) == (0.5, True, [2, 3, 4])
    assert config.max_steps is None  # 0: by epochs

    invoke(*given, "--layer-ids", "1,15,28")
    assert settings_of(calls[2]).layer_ids == [1, 15, 28]


def test_train_help_shows_the_settings_defaults(monkeypatch):
    monkeypatch.setattr(pipeline.cli, "rich_help", lambda: True)  # a wide terminal: one line an option
    result = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for line in ("--draft-vocab-size", "--ttt-steps", "--max-length"):
        shown = next(text for text in result.output.splitlines() if line in text)
        assert f"[default: {TrainConfig.model_fields[line[2:].replace('-', '_')].default}]" in shown


def test_generate_with_no_options_runs_the_configs_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("EYRIE_GENERATE_RESTART", raising=False)
    _, calls = implementation(monkeypatch, "pipeline.steps.generate.driver", "generate")
    prompts = tmp_path / "prompts.jsonl"
    invoke("generate", str(prompts), "--url", "http://target:30000", "--out-dir", str(tmp_path))
    expected = GenerateConfig(prompts=prompts, out_dir=tmp_path, urls=["http://target:30000"])
    assert calls[0].arguments["config"] == expected
    assert expected.request_timeout_s == expected.health_timeout_s == 600  # "10m", read as the model reads it


def test_generate_options_given_reach_the_config(monkeypatch, tmp_path):
    monkeypatch.delenv("EYRIE_GENERATE_RESTART", raising=False)
    _, calls = implementation(monkeypatch, "pipeline.steps.generate.driver", "generate")
    invoke(
        "generate",
        str(tmp_path / "p.jsonl"),
        "--url",
        "http://target:30000",
        "--out-dir",
        str(tmp_path),
        "--temperature",
        "0",
        "--max-tokens",
        "64",
        "--retry-base",
        "2",
        "--health-timeout",
        "1h30m",
        "--chat-template-kwargs",
        '{"enable_thinking": true}',
        "--drop-truncated",
    )
    config = calls[0].arguments["config"]
    assert (config.sampling.temperature, config.sampling.max_tokens, config.sampling.top_p) == (0, 64, 1.0)
    assert (config.retry.base_s, config.retry.max_retries, config.health_timeout_s) == (2, 6, 5400)
    assert config.chat_template_kwargs == {"enable_thinking": True} and config.drop_truncated


def test_prep_and_tokenize_with_no_options_run_their_models_defaults(monkeypatch):
    _, calls = implementation(monkeypatch, "pipeline.steps.prep.run", "run_prep")
    invoke("prep")
    assert calls[0].args == (None, None) and calls[0].kwargs == PrepConfig().model_dump()
    assert PrepConfig().quota is None  # 0: the catalog's own quotas
    _, calls = implementation(monkeypatch, "pipeline.steps.tokenize.run", "run_tokenize")
    invoke("tokenize", "--tokenizer", "model")
    assert calls[0].args == ("model", [], [], None)
    assert calls[0].kwargs == {**TokenizeConfig().model_dump(), "trust_remote_code": False}


def test_accept_with_no_options_runs_its_models_defaults(monkeypatch):
    _, calls = implementation(monkeypatch, "pipeline.steps.accept.measure", "run_accept")
    invoke("accept", "--draft", "d", "--target", "t", "--data", "x")
    config = AcceptConfig(draft="d", target="t", data="x")
    assert calls[0].arguments["settings"] == config.settings(trust_remote_code=False, release_target=None)
    assert calls[0].arguments["out_dir"] is None
    assert (config.startup_timeout_s, config.request_timeout_s) == (3600, 600)


@pytest.mark.parametrize(
    ("step", "module", "function", "required"),
    [
        ("prep", "pipeline.steps.prep.run", "run_prep", []),
        ("tokenize", "pipeline.steps.tokenize.run", "run_tokenize", ["--tokenizer", "model"]),
    ],
)
def test_a_step_run_with_no_options_gets_its_functions_defaults(
    monkeypatch, step, module, function, required
):
    signature, calls = implementation(monkeypatch, module, function)
    invoke(step, *required)
    passed = calls[0].arguments
    defaults = {n: p.default for n, p in signature.parameters.items() if p.default is not p.empty}
    given = {n: value for n, value in passed.items() if n in defaults}
    assert len(given) > 3 and given == {n: defaults[n] for n in given}


def test_accept_reads_the_rows_training_held_out_with_trainings_defaults():
    accept = options(command("accept"))
    for name in ("heldout_fraction", "max_length"):
        assert accept[name].default == TrainConfig.model_fields[name].default


@pytest.mark.parametrize(
    "args,line",
    [
        (("prep", "--quota", "-1"), "--quota: Input should be greater than or equal to 0, got -1"),
        (
            ("generate", "p.jsonl", "--url", "http://target:30000", "--max-error-rate", "1.5"),
            "--max-error-rate: Input should be less than or equal to 1, got 1.5",
        ),
        (
            ("generate", "p.jsonl", "--url", "http://target:30000", "--top-p", "0"),
            "--top-p: Input should be greater than 0, got 0.0",
        ),
        (
            ("tokenize", "--tokenizer", "model", "--workers", "0"),
            "--workers: Input should be greater than or equal to 1, got 0",
        ),
        (
            ("train", "--data", "shards", "--target", "model", "--batch-size", "0"),
            "--batch-size: Input should be greater than or equal to 1, got 0",
        ),
        (
            ("accept", "--draft", "d", "--target", "t", "--data", "x", "--prompts", "0"),
            "--prompts: Input should be greater than or equal to 1, got 0",
        ),
        (
            ("accept", "--draft", "d", "--target", "t", "--data", "x", "--num-steps", "x"),
            "--num-steps: Input should be a valid integer, unable to parse string as an integer, got 'x'",
        ),
        (
            ("accept", "--draft", "d", "--target", "t", "--data", "x", "--tp", "0"),
            "--tp 0: SGLang spans at least one GPU",
        ),
    ],
)
def test_a_value_out_of_range_is_one_line_naming_its_option_and_exit_2(monkeypatch, tmp_path, args, line):
    monkeypatch.setenv("EYRIE_STEP_DIR", str(tmp_path))
    steps = [
        ("pipeline.steps.prep.run", "run_prep"),
        ("pipeline.steps.tokenize.run", "run_tokenize"),
        ("pipeline.steps.generate.driver", "generate"),
        ("pipeline.steps.accept.measure", "run_accept"),
        ("pipeline.steps.train.cli", "check_inputs"),
    ]
    calls = [implementation(monkeypatch, module, name)[1] for module, name in steps]
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"error: {line}"
    assert calls == [[]] * len(steps)  # nothing ran


def test_the_build_runs_with_the_release_whose_profiles_ship():
    from pipeline.compile.flash_attn import DEFAULT_HEADROOM, FLASH_ATTN_VERSION, size_option

    build = options(command("build", "flash-attn"))
    assert build["version"].default == FLASH_ATTN_VERSION
    assert size_option("--headroom", build["headroom"].default) == DEFAULT_HEADROOM


def test_a_step_that_uses_the_target_service_releases_it_unless_told_otherwise(monkeypatch):
    _, calls = implementation(monkeypatch, "pipeline.steps.accept.measure", "run_accept")
    given = ("accept", "--draft", "d", "--target", "t", "--data", "x")
    monkeypatch.setenv("EYRIE_SERVICE_TARGET_URLS", "http://gpu01:30001")  # as the runner sets it
    invoke(*given)
    assert calls[0].arguments["settings"].release_target == "http://gpu01:30001"
    invoke(*given, "--release-target", "no")
    assert calls[1].arguments["settings"].release_target is None
    # Several replicas: a step takes the GPUs of one server, so it is told which, in one line.
    monkeypatch.setenv("EYRIE_SERVICE_TARGET_URLS", "http://gpu01:30001,http://gpu02:30002")
    result = CliRunner().invoke(app, list(given))
    assert result.exit_code == 2 and len(calls) == 2
    (line,) = [text for text in result.output.splitlines() if text.strip()]
    assert "--release-target: 'http://gpu01:30001,http://gpu02:30002' names several servers" in line
