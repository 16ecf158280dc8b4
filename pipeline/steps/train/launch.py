"""How the processes of one training start: ``torchrun``'s launcher, run in-process by ``eyrie train``
with ``nproc``/``nnodes`` above 1 (each worker joins its process group in ``loop.py``).

The launcher re-executes the step once per worker (``python -m pipeline.steps.train``) and waits for
them. It outlives every worker, so what it plans and runs before them (the placement, the offline
features pass) runs in a child process of its own: their CUDA contexts and rows go with it.

Light on purpose (torch is imported where it is used): ``eyrie train`` imports it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.run.step_contract import EXIT_BAD_INPUT, EXIT_FAILED, atomic_write_text
from pipeline.steps.train.config import TrainConfig

RESOLVED = "train_config.json"


def say(message: str) -> None:
    """``message`` on stderr, each line an ``error:`` line."""
    for line in message.splitlines():
        print(f"error: {line}", file=sys.stderr, flush=True)


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
