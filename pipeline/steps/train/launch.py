"""How the processes of one training start, and what each runs: ``torchrun``'s launcher, run
in-process by ``eyrie train`` with ``nproc``/``nnodes`` above 1 (each worker joins its process group
in ``loop.py``), and the worker's body (:func:`worker`: train; on rank 0, export the draft and
evaluate it), which ``eyrie train`` also runs in-process when it trains alone.

The launcher writes the settings it resolved (``train_config.json``), re-executes the step once per
worker (``python -m pipeline.steps.train``, which reads them back: :func:`worker_main`) and waits
for them. It outlives every worker, so what it plans and runs before them (the placement, the
offline features pass) runs in a child process of its own: their CUDA contexts and rows go with it.

Light on purpose (torch is imported where it is used): ``eyrie train`` imports it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from pydantic import ValidationError

from pipeline.contract.atomic import atomic_write_text
from pipeline.contract.exits import EXIT_BAD_INPUT, EXIT_FAILED
from pipeline.steps.options import validation_lines
from pipeline.steps.target import TargetError
from pipeline.steps.train.config import SettingsError, TrainConfig
from pipeline.steps.train.placement import PlacementError

RESOLVED = "train_config.json"
DRAFT = "draft"
EVAL = "eval.json"


def say(message: str) -> None:
    """``message`` on stderr, each line an ``error:`` line."""
    for line in message.splitlines():
        print(f"error: {line}", file=sys.stderr, flush=True)


def bad_input_errors() -> tuple[type[Exception], ...]:
    """What the step raises for wrong settings or input (shards it cannot use, a target it cannot
    load or place, too little disk for the features): said in one line, exit 2, nothing to resume.
    Any other error is a failure, with its traceback. Imported when needed: this module stays
    light for `eyrie --help`."""
    from pipeline.steps.target.holding import HeldFormatError
    from pipeline.steps.train.loop import TrainingInputError
    from pipeline.steps.train.offline import FeaturesError

    return (SettingsError, TargetError, PlacementError, FeaturesError, TrainingInputError, HeldFormatError)


def launch_workers(cfg: TrainConfig, resolved: Path) -> tuple[int, bool]:
    """Run torchrun's launcher here; returns (exit code, whether this node ran global rank 0).

    In-process, a worker's exit code (2: bad input) is known and the launcher's own
    traceback is not printed for it; torch's launch API also says which global ranks ran here.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    # One node: what --standalone means (torchrun's run() applies it, config_from_args does not).
    rendezvous = ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0"] if cfg.nnodes == 1 else []
    args = parse_args(
        [f"--nproc-per-node={cfg.nproc}", f"--nnodes={cfg.nnodes}", *rendezvous]
        + ["-m", "pipeline.steps.train", str(resolved)]
    )
    if args.master_port is None:
        args.master_port = 29500  # torchrun's default for a static rendezvous
    config, entrypoint, entry_args = config_from_args(args)
    try:
        finished = elastic_launch(config, entrypoint)(*entry_args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode == EXIT_BAD_INPUT:
            return EXIT_BAD_INPUT, False  # the worker said why
        code = failure.exitcode
        how = f"died of signal {-code}" if code < 0 else f"exited with {code}"
        checkpoints = cfg.out_dir / "checkpoints"
        say(f"worker rank {rank} {how}; a rerun resumes from the last checkpoint in {checkpoints}")
        return EXIT_FAILED, False
    except SignalException as exc:
        say(f"stopped by signal {exc.sigval}; a rerun resumes from the last checkpoint")
        return 128 + int(exc.sigval), False
    return 0, 0 in finished  # keyed by global rank


def _in_child(function, *args):
    """``function(*args)`` in a child process of its own, started for it: what it loads (CUDA contexts
    on every GPU it measures or uses, the rows, the target) goes when it ends, and the launcher,
    which waits for the workers as long as they train, keeps none of it."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def offline_features(cfg: TrainConfig) -> None:
    """The offline features pass, in one process over every GPU, before the workers train from its shards."""
    from pipeline.steps.train.loop import features_pass, prepare

    setup = prepare(cfg, world=1)
    for line in setup.plan.describe():
        print(line, flush=True)
    features_pass(cfg, setup, lambda line: print(line, flush=True))


def _launch_plan(cfg: TrainConfig, devices) -> tuple[str, str]:
    """(placement, reason) of ``auto`` for the launching process: the target alone, every GPU."""
    from pipeline.steps.train.loop import prepare

    plan = prepare(cfg, world=1, devices=devices).plan
    return plan.placement, plan.reason


def placement_for_launch(cfg: TrainConfig, devices=None) -> TrainConfig:
    """What several processes on one node hold. ``sharded`` is one process over every GPU; with
    ``auto`` each rank holds the target when one GPU holds it beside the draft (replicated), and
    otherwise it is sharded over every GPU, in one process."""
    if cfg.nproc == 1 or cfg.nnodes > 1 or cfg.target_placement not in ("auto", "sharded"):
        return cfg
    if cfg.target_placement == "sharded":
        print(
            f"target placement sharded: one process trains over every GPU, not --nproc {cfg.nproc}",
            flush=True,
        )
        return cfg.model_copy(update={"nproc": 1})
    placement, reason = _in_child(_launch_plan, cfg, devices)
    if placement != "sharded":
        return cfg
    print(f"target placement auto: {reason}; one process trains, not --nproc {cfg.nproc}", flush=True)
    return cfg.model_copy(update={"nproc": 1, "target_placement": "sharded"})


def launch(cfg: TrainConfig) -> int | None:
    """Train under torchrun, its workers started here (the offline features pass first); an exit
    code, or None when this node ran global rank 0, which wrote the draft and eval.json."""
    if cfg.target_placement == "offline":
        _in_child(offline_features, cfg)
    resolved = cfg.out_dir / RESOLVED
    atomic_write_text(resolved, cfg.model_dump_json(indent=2))
    rc, ran_rank_0 = launch_workers(cfg, resolved)
    if rc != 0:
        return rc
    if not ran_rank_0:
        # Only global rank 0 exports and evaluates: its node vouches for the outputs.
        print(
            "note: this node's workers are done; the node of global rank 0 writes the draft and the manifest",
            file=sys.stderr,
        )
        return 0
    return None


# -- a worker -----------------------------------------------------------------------------
def read_resolved(path: Path) -> TrainConfig:
    """The settings the launcher resolved for the torchrun workers."""
    try:
        return TrainConfig.model_validate_json(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SettingsError(f"{path}: cannot read it: {exc.strerror}") from None
    except ValidationError as exc:
        raise SettingsError(validation_lines(exc, TrainConfig, lambda _: str(path))) from None


def worker(cfg: TrainConfig) -> int:
    """Train; on global rank 0, export the draft and evaluate it into eval.json."""
    import torch

    from pipeline.steps.eagle3.decoding import eos_ids_of, real_acceptance
    from pipeline.steps.eagle3.export import export_draft
    from pipeline.steps.train.loop import simulated_acceptance, target_for_evaluation, train

    result = train(cfg)
    if result["rank"] != 0:
        return 0
    built = result["built"]
    setup, draft = built.setup, built.draft.eval()
    export_draft(draft, cfg.out_dir / DRAFT, setup.layer_ids, dtype=setup.dtype)
    started = time.monotonic()
    simulated = simulated_acceptance(
        built.source,
        draft,
        setup.heldout,
        cfg.ttt_steps,
        setup.pad_id,
        batch_size=cfg.batch_size,
        loss_chunk=cfg.loss_chunk,
        precision=setup.precision,
    )
    prompts = setup.heldout[: cfg.eval_prompts]
    target = target_for_evaluation(cfg, built) if prompts else None
    real = real_acceptance(
        target,
        draft,
        prompts,
        cfg.ttt_steps,
        cfg.eval_max_new_tokens,
        eos_ids_of(target) if target else (),
    )
    report = {
        **result["summary"],
        "k": cfg.ttt_steps,
        "simulated": simulated,
        "speculative_decoding": real,
        "eval_seconds": round(time.monotonic() - started, 1),
        "torch_threads": torch.get_num_threads(),
    }
    atomic_write_text(cfg.out_dir / EVAL, json.dumps(report, indent=2) + "\n")
    measured = real["acceptance_length"]
    decoded = f"{measured:.2f}" if measured else "not measured (--eval-prompts 0)"
    print(
        f"acceptance length (K={cfg.ttt_steps}): simulated {simulated['acceptance_length']:.2f}, "
        f"speculative decoding {decoded}",
        flush=True,
    )
    return 0


def worker_main(resolved: Path) -> int:
    """A torchrun worker's entry: bad settings or input are one line (from each node's first
    worker, the others would repeat it) and exit 2, which tells the launcher not to offer a resume."""
    try:
        worker(read_resolved(resolved))
    except bad_input_errors() as exc:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            say(str(exc))
        return EXIT_BAD_INPUT
    return 0
