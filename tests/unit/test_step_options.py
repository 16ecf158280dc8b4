"""Each step's options are stated once, in the step's own module, with their defaults from the one
definition the step runs with: a command run with no options hands the step exactly its defaults,
and ``--help`` shows them."""

from __future__ import annotations

import importlib
import inspect

import pytest
import typer
import yaml
from typer.core import TyperGroup
from typer.testing import CliRunner

import pipeline.cli
from pipeline.cli import STEP_COMMANDS, app
from pipeline.steps.generate.config import GenerateConfig
from pipeline.steps.train import cli as train_cli
from pipeline.steps.train.config import TrainConfig

EYRIE = typer.main.get_command(app)


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


def test_every_training_setting_is_an_option_with_the_settings_default_and_help():
    train = options(command("train"))
    for name, field in TrainConfig.model_fields.items():
        if name in ("trust_remote_code", "release_target"):
            continue  # permissions the command grants (shared with the other steps), checked below
        option = train[name]
        default = None if field.is_required() else field.get_default()
        if isinstance(default, list):
            default = ",".join(map(str, default))
        assert (option.required, option.default) == (field.is_required(), default), name
        assert option.help == field.description, name


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


def test_train_help_shows_the_settings_defaults():
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
    assert calls[0].arguments["config"] == GenerateConfig(prompts, tmp_path, ["http://target:30000"])


@pytest.mark.parametrize(
    ("step", "module", "function", "required"),
    [
        ("prep", "pipeline.steps.prep.prep", "prep", []),
        ("tokenize", "pipeline.steps.tokenize.tokenize", "tokenize", ["--tokenizer", "model"]),
    ],
)
def test_a_step_run_with_no_options_gets_its_functions_defaults(monkeypatch, step, module, function,
                                                                required):  # fmt: skip
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


def test_the_build_runs_with_the_release_whose_profiles_ship():
    from pipeline.compile.flash_attn import DEFAULT_HEADROOM, FLASH_ATTN_VERSION, size_option

    build = options(command("build", "flash-attn"))
    assert build["version"].default == FLASH_ATTN_VERSION
    assert size_option("--headroom", build["headroom"].default) == DEFAULT_HEADROOM
