"""The real job (``pipeline/jobs/eagle3.yaml``) gives a step's setting a value of its own only
where it means to: every value it passes to an ``eyrie <step>`` option, a ``${EYRIE_X:-default}``'s
default or a literal, is the step's own default (a variable left settable) or a difference listed in
``DELIBERATE`` with its reason. A default is stated once, in the step's settings model; the file's
header says the same defaults its command lines do."""

from __future__ import annotations

import inspect
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from pydantic import BaseModel

from eyrie_testing import REAL_JOB
from pipeline.cli import app
from pipeline.steps.accept.config import AcceptConfig
from pipeline.steps.generate.config import GenerateSettings
from pipeline.steps.prep.config import PrepConfig
from pipeline.steps.serving.serve_command import ServeConfig
from pipeline.steps.tokenize.config import TokenizeConfig
from pipeline.steps.train.config import TrainConfig

SETTINGS: dict[str, type[BaseModel]] = {
    "prep": PrepConfig,
    "generate": GenerateSettings,
    "tokenize": TokenizeConfig,
    "train": TrainConfig,
    "accept": AcceptConfig,
    "serve": ServeConfig,
}
INPUTS = {
    "train": {"data": "shards", "target": "model"},
    "accept": {"draft": "d", "target": "t", "data": "x"},
}
"""What a model needs given before its defaults can be read (its required inputs)."""

ROWS = (
    "the host's GPUs train 4,096-token rows (docs/steps/train.md plans them); the steps' own default "
    "is sized for any host, a CPU included; tokenize, train and accept take the one value"
)
DELIBERATE = {
    ("generate", "concurrency"): "SGLang on the host's 8 GPUs keeps a batch of 128 full; the step's own "
    "suits any one server, a CPU's `transformers serve` included",
    ("generate", "seed"): "the real job's rows are repeatable (each row's seed derives from its id): a "
    "rerun or a retried request asks for the same answer",
    ("generate", "health_timeout_s"): "a target replica that dies is started again by the runner and loads "
    "the target again (Kimi-K2.5: 595 GB); generate waits the outage out instead of giving up",
    ("tokenize", "max_length"): ROWS,
    ("train", "max_length"): ROWS,
    ("accept", "max_length"): ROWS,
    ("train", "nproc"): "one training process per GPU of the host's 8 (EYRIE_TRAIN_PROCESSES)",
    ("train", "eval_prompts"): "accept measures decoding for real; train keeps its simulated figure only",
    ("accept", "tp"): "SGLang spans the host's GPUs (EYRIE_GPUS), as the target service does",
    ("serve", "tp"): "SGLang spans the host's GPUs (EYRIE_GPUS)",
}
"""(step, setting) -> why the real job's value differs from the step's own default."""

VARIABLE = re.compile(r"\$\{(EYRIE_\w+):-([^}]*)\}")


def _command(name: str):
    group = typer.main.get_command(app)
    return group.get_command(typer.Context(group), name)


def _declared(command) -> set[str]:
    """The options the step's command declares itself (shared ones, its inputs), not its model's."""
    return set(inspect.signature(inspect.unwrap(command.callback)).parameters)


def _fields(model: type[BaseModel]) -> dict[str, str | None]:
    """Every setting of ``model`` by name, with the field grouping it (generate's ``sampling``)."""
    found: dict[str, str | None] = {}
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            found.update(dict.fromkeys(kind.model_fields, name))
        else:
            found[name] = None
    return found


def _model_value(step: str, name: str, value: Any = inspect.Parameter.empty) -> Any:
    """The setting ``name`` as the step's model holds it: its default, or ``value`` read as the
    command line gives it (a list comma-separated)."""
    model, group = SETTINGS[step], _fields(SETTINGS[step])[name]
    given: dict[str, Any] = dict(INPUTS.get(step, {}))
    if value is not inspect.Parameter.empty:
        holder = model if group is None else model.model_fields[group].annotation
        if typing.get_origin(holder.model_fields[name].annotation) is list:
            value = value.split(",")
        given.update({group: {name: value}} if group else {name: value})
    held = model.model_validate(given)
    return getattr(getattr(held, group) if group else held, name)


def _options(command: list[str]) -> list[tuple[str, str, str | None]]:
    """(option, value, variable) of each option a command line gives a value: a ``${EYRIE_X:-d}``
    read as its default d; a value that is a path in the run (``${EYRIE_RUN_DIR}``) is skipped."""
    found = []
    words = [str(word) for word in command]
    for at, word in enumerate(words):
        option = VARIABLE.sub(r"\2", word)
        if not option.startswith("--"):
            continue
        following = words[at + 1] if at + 1 < len(words) else "--"
        said = VARIABLE.search(following) or VARIABLE.search(word)
        value = None if following.startswith("--") else VARIABLE.sub(r"\2", following)
        found.append((option, value, said[1] if said else None))
    return found


def differences(path: Path, deliberate: dict[tuple[str, str], str]) -> list[str]:
    """Each value the pipeline file at ``path`` gives a step's setting that is not the step's default
    and not in ``deliberate``; each literal that states the default again; each entry of
    ``deliberate`` that differs no longer."""
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    problems, differing = [], set()
    for entry in [*document.get("steps", []), *document.get("services", [])]:
        words = entry.get("command") or []
        if words[:1] != ["eyrie"] or words[1] not in SETTINGS:
            continue
        step, command = words[1], _command(words[1])
        params = {flag: p for p in command.params for flag in (*p.opts, *p.secondary_opts)}
        declared = _declared(command)
        for option, value, variable in _options(words[2:]):
            param = params[option]
            if param.name not in _fields(SETTINGS[step]) or param.required:
                continue  # an input, or an option of the command's own
            if param.is_flag:
                value = option in param.opts
            elif value is None or "${" in value:
                continue
            read = param.process_value(typer.Context(command), value)  # as the command line reads it
            if param.name in declared:  # a shared option, which the command hands on itself
                given, default = read, param.default
            else:
                given, default = _model_value(step, param.name, read), _model_value(step, param.name)
            where = f"{entry['name']}: {option} {value!r}" + (f" (${variable})" if variable else "")
            if given != default:
                differing.add((step, param.name))
                if (step, param.name) not in deliberate:
                    problems.append(
                        f"{where} is not {step}'s default {default!r}: give it, or say why in DELIBERATE"
                    )
            elif variable is None:
                problems.append(f"{where} states {step}'s default again: leave it to the step")
    problems += [f"DELIBERATE {key}: the file gives the default now" for key in deliberate.keys() - differing]
    return problems


def test_the_real_job_differs_from_a_steps_defaults_only_where_it_says_why():
    assert differences(REAL_JOB, DELIBERATE) == []
    assert all(len(why) > 20 for why in DELIBERATE.values())


@pytest.mark.parametrize(
    ("old", "new", "said"),
    [
        # a default of the file's that no longer is the step's
        (
            '"${EYRIE_LR:-1e-4}"',
            '"${EYRIE_LR:-3e-4}"',
            "train: --lr '3e-4' ($EYRIE_LR) is not train's default 0.0001",
        ),
        (
            '"${EYRIE_TEMPERATURE:-0.7}"',
            '"${EYRIE_TEMPERATURE:-0}"',
            "generate: --temperature '0' ($EYRIE_TEMPERATURE) is not generate's default 0.7",
        ),
        ('"--${EYRIE_PREP_DATA:-online}"', '"--${EYRIE_PREP_DATA:-offline}"', "prep: --offline True"),
        # a literal that says the default again
        ("--eval-prompts, 0,", "--eval-prompts, 0, --ttt-steps, 7,", "train: --ttt-steps '7' states"),
        # a declared difference that is one no longer
        ("--eval-prompts, 0,", "", "DELIBERATE ('train', 'eval_prompts'): the file gives the default now"),
    ],
)
def test_an_undeclared_difference_fails(tmp_path, old, new, said):
    text = REAL_JOB.read_text(encoding="utf-8")
    assert text.count(old) == 1
    changed = tmp_path / "eagle3.yaml"
    changed.write_text(text.replace(old, new), encoding="utf-8")
    problems = differences(changed, DELIBERATE)
    assert len(problems) == 1 and said in problems[0], problems


def test_without_its_declarations_the_real_job_fails_once_for_each():
    """Each declared difference is one the file makes today, none left over from an old one."""
    problems = differences(REAL_JOB, {})
    assert len(problems) == len(DELIBERATE)
    for step, _ in DELIBERATE:
        assert any(f"is not {step}'s default" in problem for problem in problems), step


def test_the_header_says_the_defaults_the_command_lines_give():
    text = REAL_JOB.read_text(encoding="utf-8")
    header = text[: text.index("\nname:")]
    given = {name: default for name, default in VARIABLE.findall(text)}
    said = {}
    for line in header.splitlines():
        if match := re.match(r"#   (EYRIE_[A-Z_]+)\s+(\(\w+[^)]*\)|\S+)", line):
            said[match[1]] = match[2]
    assert len(said) > 30
    for name, value in said.items():
        if value == "(unset)":
            assert name not in given, name  # read as the environment gives it, no default
        elif name in given:
            assert (value.startswith("(empty") and given[name] == "") or value == given[name], (name, value)
    assert set(given) - set(said) <= {name for name in given if name.endswith("_MEMORY")}


def test_the_steps_that_hand_rows_on_cut_them_at_one_length():
    """A row tokenize keeps is the row training reads, and accept finds the rows training held out."""
    lengths = {
        step: SETTINGS[step].model_fields["max_length"].default for step in ("tokenize", "train", "accept")
    }
    assert len(set(lengths.values())) == 1, lengths
