"""``eyrie train``: the pipeline step. Trains (or resumes), exports ``draft/``, evaluates into ``eval.json``.

With ``nproc``/``nnodes`` above 1 the command relaunches itself under ``torchrun``;
each worker runs :func:`worker` and rank 0 exports and evaluates. The manifest is
written last, by the launching process, after every worker has exited cleanly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from pipeline.run.manifest import atomic_write_text, step_dir_from_env, write_manifest
from pipeline.steps.train.train import TrainConfig

DRAFT = "draft"
EVAL = "eval.json"
RESOLVED = "train_config.json"


def load_config(config_file: Path | None, overrides: dict) -> TrainConfig:
    values = yaml.safe_load(config_file.read_text()) if config_file else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return TrainConfig(**values)


def worker(cfg: TrainConfig) -> int:
    import torch

    from pipeline.steps.train.evaluate import real_acceptance
    from pipeline.steps.train.export import export_draft
    from pipeline.steps.train.features import OnlineTarget
    from pipeline.steps.train.train import simulated_acceptance, train

    result = train(cfg)
    if result["rank"] != 0:
        return 0
    target, draft, heldout = result["target"], result["draft"].eval(), result["heldout"]
    export_draft(draft, cfg.out / DRAFT, dtype=target.dtype)
    pad_id = target.config.pad_token_id or 0
    source = OnlineTarget(target, result["summary"]["layer_ids"], draft.d2t.cpu(), draft.t2d.cpu())
    started = time.monotonic()
    simulated = simulated_acceptance(source, draft, heldout, cfg.ttt_steps, pad_id)
    real = real_acceptance(
        target, draft, heldout[: cfg.eval_prompts], cfg.ttt_steps, cfg.eval_max_new_tokens,
        target.generation_config.eos_token_id or target.config.eos_token_id,
    )  # fmt: skip
    report = {
        **result["summary"],
        "k": cfg.ttt_steps,
        "simulated": simulated,
        "speculative_decoding": real,
        "eval_seconds": round(time.monotonic() - started, 1),
        "torch_threads": torch.get_num_threads(),
    }
    atomic_write_text(cfg.out / EVAL, json.dumps(report, indent=2) + "\n")
    real_length = real["acceptance_length"] or float("nan")
    print(
        f"acceptance length (K={cfg.ttt_steps}): simulated {simulated['acceptance_length']:.2f}, "
        f"speculative decoding {real_length:.2f}",
        flush=True,
    )
    return 0


def train_command(config_file: Path | None, **overrides) -> int:
    step_dir = step_dir_from_env()
    overrides.setdefault("out", None)
    cfg = load_config(config_file, overrides)
    if cfg.out == Path("."):
        cfg.out = step_dir
    cfg.out.mkdir(parents=True, exist_ok=True)
    for required, what in ((cfg.data, "--data"), (cfg.target, "--target")):
        if not required.exists():
            print(f"eyrie train: {what} {required} does not exist (run its step first)", file=sys.stderr)
            return 2
    if cfg.nproc * cfg.nnodes > 1 and "LOCAL_RANK" not in os.environ:
        resolved = cfg.out / RESOLVED
        atomic_write_text(resolved, cfg.model_dump_json(indent=2))
        launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.nproc}"]
        launch += ["--standalone"] if cfg.nnodes == 1 else [f"--nnodes={cfg.nnodes}"]
        rc = subprocess.call([*launch, "-m", "pipeline.steps.train", str(resolved)])
        if rc != 0:
            where = cfg.out / "checkpoints"
            print(f"eyrie train: torchrun exited with {rc}; a rerun resumes from {where}", file=sys.stderr)
            return rc
    else:
        try:
            worker(cfg)
        except (ValueError, FileNotFoundError) as exc:  # bad data or config: one line, not a traceback
            print(f"eyrie train: {exc}", file=sys.stderr)
            return 2
    report = json.loads((cfg.out / EVAL).read_text())
    outputs = [os.path.relpath(cfg.out / name, step_dir) for name in (DRAFT, EVAL)]
    stats = {k: report[k] for k in ("optimizer_steps", "simulated", "speculative_decoding")}
    write_manifest(step_dir, outputs, stats=stats)
    return 0
