"""``eyrie train``: the pipeline step. Trains (or resumes), exports ``draft/``, evaluates into ``eval.json``.

With ``nproc``/``nnodes`` above 1 the command runs ``torchrun``'s launcher in-process (``launch.py``);
each worker (``python -m pipeline.steps.train``) runs ``launch.worker`` and rank 0 exports
and evaluates. The manifest is written last, by the launching process of the node that
ran rank 0, after every worker has exited cleanly. Several nodes must share the output
folder: every rank resumes from the checkpoint rank 0 saved. With the offline placement the
launching process has the target's features pass run first, and the workers train from its shards.

Exit codes: 0 done; 1 training failed, or the target server could not be reached (a rerun resumes
from the last checkpoint); 2 bad settings or input, said in one line per problem; 128+N stopped by
signal N.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from pydantic import ValidationError

from pipeline.contract.exits import EXIT_BAD_INPUT, EXIT_FAILED
from pipeline.contract.step import step_dir_from_env, write_manifest
from pipeline.steps.options import (
    ReleaseTarget,
    TrustRemoteCode,
    checking,
    settings_options,
    stop_when_checking,
    validation_lines,
)
from pipeline.steps.serving.sglang import (
    SGLangRefused,
    SGLangUnavailable,
    Terminated,
    gpus_released,
    release_url,
)
from pipeline.steps.target import TargetError, check_target, target_config
from pipeline.steps.target.vision_language import language_config
from pipeline.steps.train.config import SettingsError, TrainConfig
from pipeline.steps.train.launch import (
    DRAFT,
    EVAL,
    bad_input_errors,
    launch,
    placement_for_launch,
    say,
    worker,
)


def _read_yaml(config_file: Path) -> dict:
    try:
        values = yaml.safe_load(config_file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SettingsError(f"{config_file}: cannot read it: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{config_file}:{mark.line + 1}" if mark else str(config_file)
        raise SettingsError(f"{where}: not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    if values is None:  # an empty file sets nothing
        return {}
    if not isinstance(values, dict):
        raise SettingsError(f"{config_file}: expected 'setting: value' lines, got a {type(values).__name__}")
    return values


def load_config(config_file: Path | None, overrides: dict) -> TrainConfig:
    """The settings from ``config_file`` with the command line's ``overrides`` on top."""
    given = {k: v for k, v in overrides.items() if v is not None}
    values = {**(_read_yaml(config_file) if config_file else {}), **given}

    def where_of(name: str) -> str:
        if name in given or config_file is None:
            return "--" + name.replace("_", "-")
        return str(config_file)

    try:
        return TrainConfig.model_validate(values)
    except ValidationError as exc:
        raise SettingsError(validation_lines(exc, TrainConfig, where_of)) from None


def check_settings(cfg: TrainConfig) -> None:
    """What the settings alone refuse, before any input is read."""
    if cfg.target_placement == "offline" and cfg.nnodes > 1:
        raise SettingsError(
            "--target-placement offline runs on one node (--nnodes 1): its features pass, which every "
            "process then reads, is written before the workers start"
        )
    if cfg.target_placement == "sharded" and cfg.nnodes > 1:
        raise SettingsError(
            "--target-placement sharded runs in one process over one node's GPUs: drop --nnodes "
            "(or use replicated, one copy of the target per process, on several nodes)"
        )


def plan_at_check(cfg: TrainConfig) -> None:
    """For ``eyrie run --check``: the placement plan training makes at start, from the target's
    config.json alone (its modules and the draft on the meta device: no weights, no rows; each row
    taken at --max-length), on this host's devices; a PlacementError when refused. A target whose
    config.json is not on disk yet (a hub id, a folder a step writes) is planned when train starts."""
    if not (Path(cfg.target) / "config.json").is_file():
        return
    import torch

    from pipeline.steps.eagle3.model import Eagle3Draft, default_layer_ids, draft_config
    from pipeline.steps.train.loop import plan_for
    from pipeline.steps.train.precision import dtype_of, resolve

    checkpoint = target_config(cfg.target, trust_remote_code=cfg.trust_remote_code)
    config = language_config(checkpoint)
    layer_ids = cfg.layer_ids or default_layer_ids(config.num_hidden_layers)
    vocab = min(cfg.draft_vocab_size, config.vocab_size)
    with torch.device("meta"):
        draft = Eagle3Draft(draft_config(config, vocab, layer_ids))
    # As the launcher plans: one process over every GPU, unless each process holds the target.
    world = cfg.nproc * cfg.nnodes if cfg.target_placement == "replicated" else 1
    plan_for(cfg, checkpoint, draft, dtype_of(resolve(cfg.precision)), world, cfg.max_length)


def check_inputs(cfg: TrainConfig) -> None:
    from pipeline.steps.eagle3.model import check_draftable

    check_settings(cfg)
    if not cfg.data.exists():
        raise SettingsError(f"--data {cfg.data} does not exist (run its step first)")
    try:
        check_target(cfg.target, "--target")
        config = target_config(cfg.target, trust_remote_code=cfg.trust_remote_code)
    except TargetError as exc:
        raise SettingsError(str(exc)) from None
    try:  # what the served draft could not run is refused before the weights load
        check_draftable(language_config(config))
    except ValueError as exc:
        raise SettingsError(f"--target {cfg.target}: {exc}") from None


def _train_here(cfg: TrainConfig) -> int | None:
    """Train (in this process or under torchrun); an exit code, or None when this node's
    rank 0 wrote the draft and eval.json, whose manifest is still to write."""
    if "LOCAL_RANK" not in os.environ:
        cfg = placement_for_launch(cfg)
    if cfg.nproc * cfg.nnodes > 1 and "LOCAL_RANK" not in os.environ:
        return launch(cfg)
    worker(cfg)
    return None


def train_command(config_file: Path | None, **overrides) -> int:
    step_dir = step_dir_from_env()
    overrides.setdefault("out_dir", None)
    try:
        cfg = load_config(config_file, overrides)
        if cfg.out_dir == Path("."):
            cfg.out_dir = step_dir
        if checking():
            check_settings(cfg)
            plan_at_check(cfg)
            stop_when_checking()
        check_inputs(cfg)
    except bad_input_errors() as exc:
        say(str(exc))
        return EXIT_BAD_INPUT
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    try:
        with gpus_released(cfg.release_target, step_dir):
            rc = _train_here(cfg)
    except (*bad_input_errors(), SGLangRefused) as exc:
        say(str(exc))
        return EXIT_BAD_INPUT
    except SGLangUnavailable as exc:
        say(f"{exc}; a rerun tries again")
        return EXIT_FAILED
    except Terminated as exc:
        say(f"{exc}; a rerun resumes from the last checkpoint in {cfg.out_dir}/checkpoints")
        return 128 + exc.signum
    if rc is not None:
        return rc
    report = json.loads((cfg.out_dir / EVAL).read_text())
    outputs = [os.path.relpath(cfg.out_dir / name, step_dir) for name in (DRAFT, EVAL)]
    recorded = (
        "optimizer_steps",
        "precision",
        "attention",
        "simulated",
        "speculative_decoding",
        "target_placement",
    )
    stats = {k: report[k] for k in recorded}
    write_manifest(step_dir, outputs, stats=stats)
    return 0


@settings_options(TrainConfig, checks_itself=True)
def train(
    config: Annotated[
        Path | None, typer.Option(help="YAML of these settings (names with _); options given here win.")
    ] = None,
    trust_remote_code: TrustRemoteCode = False,
    release_target: ReleaseTarget = "no",
    **settings: Any,
) -> None:
    """Train an EAGLE-3 draft on the target's features; export it for SGLang; measure acceptance."""
    raise typer.Exit(
        train_command(
            config,
            **settings,
            trust_remote_code=trust_remote_code or None,
            release_target=release_url(release_target),
        )
    )
