"""The training loop: target features in, an EAGLE-3 draft out, resumable after ``kill -9``.

Where the frozen target lives is planned first (``placement.py``): on this process's device
(replicated; under ``torchrun`` one process per device, DDP on the draft, gloo on CPU, NCCL on GPU),
split over every GPU in one process (sharded), or run once beforehand to write its features to
disk (offline). The loop is the same for all three.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.contract.atomic import atomic_write_text
from pipeline.steps.eagle3.model import (
    Eagle3Draft,
    default_layer_ids,
    draft_config,
    shift_left,
    soft_cross_entropy,
    vocab_map,
)
from pipeline.steps.shards import Rows, load_shards, split_heldout
from pipeline.steps.target import load_head, load_model, target_config, weights_key
from pipeline.steps.target.format import TargetFormat, target_format
from pipeline.steps.target.meta import MetaTarget, meta_target
from pipeline.steps.train import checkpoint as ckpt
from pipeline.steps.train.config import TrainConfig
from pipeline.steps.train.data import RowBatches, TokenBatches, collate, token_counts
from pipeline.steps.train.features import (
    LOGITS_CHUNK,
    FeatureSource,
    OfflineFeatures,
    OnlineTarget,
    TargetBatch,
    TeacherHead,
    check_layer_ids,
)
from pipeline.steps.train.offline import FeatureShards, is_complete, pending_pass, write_features
from pipeline.steps.train.placement import Device, Plan, draft_bytes, measure_devices, units_of
from pipeline.steps.train.placement import plan as plan_placement
from pipeline.steps.train.precision import autocast, dtype_of, emulated_note, resolve, training_device_type


class TrainingInputError(ValueError):
    """The data or the settings cannot be trained on (found while preparing or resuming): one line."""


class DraftLoss(nn.Module):
    """The draft plus its TTT loss, as one module so DDP sees every parameter used in forward."""

    def __init__(self, draft: Eagle3Draft, steps: int, decay: float, chunk: int, recompute: bool = False):
        super().__init__()
        self.draft, self.steps, self.decay, self.chunk, self.recompute = draft, steps, decay, chunk, recompute

    def forward(self, input_ids, loss_mask, target: TargetBatch):
        # Position p sees the token after it (p + 1) and the target's feature at p.
        outs = self.draft(shift_left(input_ids, 1), target.features, self.steps, self.recompute)
        total = torch.zeros((), device=input_ids.device)
        stats = []
        T = input_ids.shape[1]
        for k, out in enumerate(outs):
            # Step k at p predicts token p + 2 + k; its teacher is the target's distribution at
            # p + 1 + k. Views, not shifted copies: the chunks keep what they are given for the backward.
            reach = max(0, T - k - 1)
            teacher = target.teacher[:, k + 1 :]
            mask = shift_left(loss_mask, k + 2, False)[:, :reach] & target.in_draft_vocab[:, k + 1 :]
            loss_sum, correct, count = self._chunked_loss(out[:, :reach], teacher, mask)
            total = total + self.decay**k * loss_sum / count.clamp(min=1)
            stats.append((loss_sum.detach(), correct, count))
        return total, stats

    def _chunked_loss(self, out, teacher, mask):
        """Loss over the draft vocabulary ``chunk`` positions at a time (rows of a batch of short rows
        together), logits recomputed in backward."""
        zero = torch.zeros((), device=out.device, dtype=torch.long)
        sums = [zero.float(), zero, zero]  # loss sum, correct argmax count, position count
        width = max(1, min(out.shape[1], self.chunk))
        rows = max(1, self.chunk // width)
        for first in range(0, out.shape[0], rows):
            for start in range(0, out.shape[1], width):
                part = (slice(first, first + rows), slice(start, start + width))
                chunk = checkpoint(self._chunk, out[part], teacher[part], mask[part], use_reentrant=False)
                sums = [a + b for a, b in zip(sums, chunk, strict=True)]
        return tuple(sums)

    def _chunk(self, out, teacher, mask):
        return soft_cross_entropy(self.draft.logits(out), teacher, mask)


# Settings that do not change what is trained: a resume may change them. The three placements
# train the same draft, so a run may resume under another. The precision counts as resolved.
_NOT_TRAINING = {
    "out_dir",
    "log_every",
    "checkpoint_every",
    "eval_prompts",
    "eval_max_new_tokens",
    "threads",
    "target_placement",
    "features_dir",
    "trust_remote_code",
    "release_target",
    "precision",
    "recompute_steps",
}


def _files_key(root: Path, pattern: str) -> list[tuple[str, int, int]]:
    """(name, size, mtime) of ``root`` (a file) or of the files under it matching ``pattern``."""
    files = sorted(f for f in root.rglob(pattern) if f.is_file()) if root.is_dir() else [root]
    return [
        (str(f.relative_to(root) if root.is_dir() else f.name), f.stat().st_size, f.stat().st_mtime_ns)
        for f in files
    ]


def _digest(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def run_settings(cfg: TrainConfig, world: int) -> dict:
    """What makes one training: its settings (its precision as resolved here), its data files, its
    world size (processes)."""
    return {
        "config": {**cfg.model_dump(mode="json", exclude=_NOT_TRAINING), "precision": resolve(cfg.precision)},
        "data": _files_key(cfg.data, "*.parquet"),
        "world": world,
    }


def run_key(cfg: TrainConfig, world: int) -> str:
    """Names the checkpoints of one training (a digest of :func:`run_settings`).

    A rerun with other data or settings starts afresh instead of resuming someone else's run.
    """
    return _digest(run_settings(cfg, world))


# Beside a training's checkpoints, the settings its key was made of.
RUN_SETTINGS = "settings.json"


def _differences(mine: dict, theirs: dict) -> str:
    """What differs between two trainings (:func:`run_settings`): ``name theirs -> mine``."""
    new, old = (
        {**mine["config"], "processes": mine["world"]},
        {**theirs["config"], "processes": theirs["world"]},
    )
    changed = [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(new | old) if new.get(k) != old.get(k)]
    return ", ".join(changed + (["the data files"] if mine["data"] != theirs["data"] else []))


def other_trainings(folder: Path, settings: dict) -> list[str]:
    """A line for each other training with checkpoints beside ``folder`` (those of ``settings``),
    naming what differs: a rerun that starts afresh because a setting changed (``auto`` measured
    other free memory and chose another number of processes, say) says so."""
    lines = []
    for other in sorted(folder.parent.iterdir()) if folder.parent.is_dir() else []:
        step = ckpt.latest_step(other)
        if other == folder or not step:
            continue
        try:
            differs = _differences(settings, json.loads((other / RUN_SETTINGS).read_text()))
        except (OSError, ValueError, KeyError):
            differs = "settings it did not record"
        lines.append(f"checkpoints of another training in {other} (step {step}) are not resumed: {differs}")
    return lines


def rows_file(cfg: TrainConfig) -> Path:
    """The memory-mapped rows of these shards at this length (other shards or lengths get another file)."""
    payload = {"data": _files_key(cfg.data, "*.parquet"), "max_length": cfg.row_limit}
    return cfg.out_dir / "rows" / f"{_digest(payload)}.arrow"


def features_folder(cfg: TrainConfig, layer_ids: list[int], dtype: torch.dtype) -> Path:
    """The offline features of this target, data, length, layers and dtype (other ones get another folder)."""
    payload = {
        "target": weights_key(cfg.target),
        "data": _files_key(cfg.data, "*.parquet"),
        "max_length": cfg.row_limit,
        "layer_ids": layer_ids,
        "dtype": str(dtype),
    }
    return (cfg.features_dir or cfg.out_dir / "features") / _digest(payload)


def _lr_lambda(total: int, warmup: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _setup_distributed() -> tuple[int, int, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def _quiet(message: str) -> None:
    """The log of ranks other than 0: rank 0 speaks for all."""


@dataclass
class Setup:
    """What training needs before the target is loaded: the same on every rank."""

    config: Any
    """The target's language model's config (a vision-language wrapper's ``text_config``)."""
    format: TargetFormat
    """The target's format as this process holds it, decided once (its ``config``: the checkpoint's)."""
    precision: str
    """The precision training computes in (``auto`` resolved): fp32 or bf16."""
    dtype: torch.dtype
    """The dtype the target is held in at that precision."""
    pad_id: int
    """What batches are padded with (positions outside the attention and loss masks)."""
    rows: Rows
    train_rows: Rows
    heldout: Rows
    d2t: torch.Tensor
    t2d: torch.Tensor
    layer_ids: list[int]
    draft: Eagle3Draft
    plan: Plan
    longest: int
    """The longest row: the width of the widest batch, which the plan sizes."""
    meta: MetaTarget | None = None
    """The target built on the meta device for the plan, until the first load fills it."""


def training_format(cfg: TrainConfig, checkpoint_config) -> TargetFormat:
    """The target's format as training holds it: on this host's GPUs (or the CPU), dequantized when
    asked."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return target_format(checkpoint_config, device_type=device_type, dequantize=cfg.dequantize_target)


def take_meta(cfg: TrainConfig, setup: Setup) -> MetaTarget:
    """The target on the meta device: the one built for the plan, once (a load fills it in place),
    then built anew from the same format."""
    meta, setup.meta = setup.meta, None
    return meta or meta_target(setup.format, setup.dtype, trust_remote_code=cfg.trust_remote_code)


def plan_for(
    cfg: TrainConfig,
    config,
    draft: Eagle3Draft,
    dtype: torch.dtype,
    world: int,
    longest: int,
    devices: list[Device] | None = None,
    placement: str | None = None,
    draft_needs: int | None = None,
    features_pass: bool = True,
    meta: MetaTarget | None = None,
) -> Plan:
    """The placement plan of this training: the target's modules, the draft's needs, the devices.

    Batches are sized at their widest: the token budget, or ``batch_size`` rows of the ``longest``
    row's length. ``meta``: the target already built on the meta device, else built here from
    ``config``, its checkpoint's.
    """
    batch_tokens = cfg.batch_tokens or cfg.batch_size * longest
    vocab = draft.config.draft_vocab_size
    if meta is None:
        meta = meta_target(training_format(cfg, config), dtype, trust_remote_code=cfg.trust_remote_code)
    units = units_of(meta, dtype, math.ceil(batch_tokens / longest), longest, vocab, LOGITS_CHUNK)
    if draft_needs is None:
        element = torch.finfo(dtype).bits // 8
        draft_needs = draft_bytes(
            draft, batch_tokens, longest, cfg.ttt_steps, cfg.loss_chunk, element, cfg.recompute_steps
        )
    devices = devices or measure_devices(every_gpu=world == 1)
    return plan_placement(
        placement or cfg.target_placement, units, devices, draft_needs, world, features_pass
    )


def prepare(cfg: TrainConfig, world: int, devices: list[Device] | None = None) -> Setup:
    """Read the target's config and the data, build the vocabulary map and the draft, plan the placement."""
    checkpoint_config = target_config(cfg.target, trust_remote_code=cfg.trust_remote_code)
    fmt = training_format(cfg, checkpoint_config)
    config = fmt.text
    precision = resolve(cfg.precision)
    dtype = dtype_of(precision)
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    try:
        rows = load_shards(cfg.data, cfg.row_limit, rows_file(cfg))
    except (ValueError, FileNotFoundError) as exc:  # shards it cannot read
        raise TrainingInputError(str(exc)) from None
    train_rows, heldout = split_heldout(rows, cfg.heldout_fraction)
    if not train_rows:
        raise TrainingInputError(f"no training rows with assistant tokens in {cfg.data}")
    vocab = config.vocab_size
    largest = rows.largest_token()
    if largest >= vocab:
        raise TrainingInputError(
            f"token id {largest} in {cfg.data} is outside the target's vocabulary ({vocab}): "
            f"tokenize the data with {cfg.target}'s tokenizer"
        )
    d2t, t2d = vocab_map(token_counts(train_rows, vocab), cfg.draft_vocab_size)
    layer_ids = cfg.layer_ids or default_layer_ids(config.num_hidden_layers)
    try:
        check_layer_ids(layer_ids, config.num_hidden_layers)
    except ValueError as exc:
        raise TrainingInputError(f"--layer-ids: {exc}") from None
    torch.manual_seed(cfg.seed)  # the same initial draft whatever was loaded before it
    draft = Eagle3Draft(draft_config(config, d2t.shape[0], layer_ids))
    longest = int(rows.lengths().max())  # rows are cut at --max-length
    # The offline pass runs once, in one process: once its features are on disk, a process plans
    # only what training holds on its own device.
    pending = cfg.target_placement == "offline" and not is_complete(features_folder(cfg, layer_ids, dtype))
    meta = meta_target(fmt, dtype, trust_remote_code=cfg.trust_remote_code)
    plan = plan_for(
        cfg, checkpoint_config, draft, dtype, world, longest, devices, features_pass=pending, meta=meta
    )
    return Setup(
        config,
        fmt,
        precision,
        dtype,
        pad_id,
        rows,
        train_rows,
        heldout,
        d2t,
        t2d,
        layer_ids,
        draft,
        plan,
        longest,
        meta,
    )


def _load(cfg: TrainConfig, setup: Setup, plan: Plan, meta: MetaTarget):
    """The target, placed by ``plan``, filled into ``meta``, the build the plan sized."""
    return load_model(
        cfg.target,
        dtype=setup.dtype,
        trust_remote_code=cfg.trust_remote_code,
        device_map=plan.device_map(),
        dequantize=cfg.dequantize_target,
        meta=meta,
    )


def features_pass(cfg: TrainConfig, setup: Setup, log) -> Path:
    """The offline placement's pass: the target, placed by the plan's features pass, writes the
    features of every row once (a complete folder is kept as is); returns the folder."""
    folder = features_folder(cfg, setup.layer_ids, setup.dtype)
    if is_complete(folder):
        log(f"features pass: complete in {folder}")
        return folder
    pending = pending_pass(setup.rows, folder, setup.config.hidden_size, setup.dtype)  # the disk first
    target = _load(cfg, setup, setup.plan.features, take_meta(cfg, setup))
    source = OnlineTarget(target, setup.layer_ids, setup.d2t, setup.t2d, device=torch.device("cpu"))
    hidden = autocast(setup.precision, training_device_type())(source.hidden)  # as online training runs it
    write_features(hidden, pending, setup.layer_ids, cfg.batch_size, setup.pad_id, log)
    del hidden, source, target  # the target's memory goes back to the devices before training starts
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return folder


@dataclass
class Built:
    setup: Setup
    source: FeatureSource
    draft: Eagle3Draft
    target: Any | None
    """The loaded target (None for offline: training holds its lm_head only)."""


def build(cfg: TrainConfig, world: int, devices: list[Device] | None, log) -> Built:
    """Plan the placement, load the target (or its features and lm_head), ready the draft."""
    setup = prepare(cfg, world, devices)
    for line in setup.plan.describe():
        log(line)
    device = torch.device(setup.plan.draft_device)
    note = emulated_note(setup.precision, device.type)
    if note:
        log(note)
    if setup.plan.placement == "offline":
        if world > 1 and not is_complete(features_folder(cfg, setup.layer_ids, setup.dtype)):
            raise TrainingInputError("the offline features pass is not complete: run it in one process first")
        folder = features_pass(cfg, setup, log)
        setup.meta = None  # training holds the lm_head only: no module of the target is kept meanwhile
        lm_head, embedding = load_head(
            cfg.target, setup.format, setup.dtype, device, trust_remote_code=cfg.trust_remote_code
        )
        head = TeacherHead(lm_head, setup.d2t, setup.t2d, LOGITS_CHUNK)
        source: FeatureSource = OfflineFeatures(FeatureShards(folder), head, device)
        target = None
    else:
        target = _load(cfg, setup, setup.plan, take_meta(cfg, setup))
        embedding = target.get_input_embeddings().weight
        source = OnlineTarget(target, setup.layer_ids, setup.d2t, setup.t2d, device=device)
    draft = setup.draft
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(embedding.float())
        draft.d2t.copy_(setup.d2t)
        draft.t2d.copy_(setup.t2d)
    return Built(setup, source, draft.to(device), target)


def target_for_evaluation(cfg: TrainConfig, built: Built):
    """The target for decoding: the one training held, or (offline) loaded now where it fits beside
    the trained draft, which is already on its device."""
    if built.target is not None:
        return built.target
    setup = built.setup
    meta = take_meta(cfg, setup)
    plan = plan_for(
        cfg,
        setup.format.config,
        built.draft,
        setup.dtype,
        1,
        setup.longest,
        placement="auto",
        draft_needs=0,
        meta=meta,
    )
    return _load(cfg, setup, plan, meta)


def resume(folder: Path, rank: int, world: int, device: torch.device) -> tuple[int, dict | None]:
    """The step every rank resumes from, that of rank 0's newest checkpoint (0: none), and its state.

    Only rank 0 saves checkpoints; a rank that took its own newest one could start from
    another step, or from scratch, and the ranks would train apart.
    """
    step = ckpt.latest_step(folder)
    if world > 1:
        agreed = torch.tensor([step], device=device)
        dist.broadcast(agreed, src=0)
        step = int(agreed)
    if not step:
        return 0, None
    state = ckpt.load(folder, step)
    if state is None:
        raise TrainingInputError(
            f"rank {rank} finds no checkpoint of step {step} in {folder}, which rank 0 resumes from: "
            "the nodes must share the output folder"
        )
    return step, state


def _log(message: str) -> None:
    print(message, flush=True)  # the runner's log is a pipe: unflushed lines would arrive at exit


def train(cfg: TrainConfig, log=_log, devices: list[Device] | None = None) -> dict:
    """Run (or resume) training to the planned number of steps; return the run's summary.

    ``devices`` overrides the measured ones (the planner's view of the machine).
    """
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rank, world, local = _setup_distributed()
    built = build(cfg, world, devices, log if rank == 0 else _quiet)
    setup, source, draft = built.setup, built.source, built.draft
    train_rows, heldout = setup.train_rows, setup.heldout
    device = torch.device(setup.plan.draft_device)

    try:
        if cfg.batch_tokens:
            batches = TokenBatches(train_rows, cfg.batch_tokens, cfg.seed, world)
        else:
            batches = RowBatches(train_rows, cfg.batch_size, cfg.seed, world)
    except ValueError as exc:
        raise TrainingInputError(str(exc)) from None
    per_epoch = batches.steps_per_epoch()
    total = cfg.max_steps or max(1, math.ceil(cfg.epochs * per_epoch))
    warmup = max(1, round(cfg.warmup_ratio * total))
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(total, warmup))

    trained = _Trained(draft, optimizer, scheduler)
    folder = cfg.out_dir / "checkpoints" / run_key(cfg, world)
    start = _resume_or_start(cfg, folder, rank, world, local, trained, total, log)

    module = DraftLoss(draft, cfg.ttt_steps, cfg.loss_decay, cfg.loss_chunk, cfg.recompute_steps)
    model = nn.parallel.DistributedDataParallel(module) if world > 1 else module
    started, tokens_seen, last = time.monotonic(), 0, {}
    for step in range(start, total):
        batch = collate(batches.at(step, rank), setup.pad_id)
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast(setup.precision, device.type):
            teacher = source(batch["input_ids"], batch["attention_mask"])
            loss, stats = model(batch["input_ids"], batch["loss_mask"], teacher)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        tokens_seen += int(batch["attention_mask"].sum())
        done = step + 1
        if done % cfg.log_every == 0 or done == total:
            last = _metrics(stats, loss, grad_norm, world)
            if rank == 0:
                accs = " ".join(f"{a:.2f}" for a in last["acc"])
                lr = scheduler.get_last_lr()[0]
                log(f"step {done}/{total} loss {last['loss']:.3f} acc {accs} lr {lr:.2e}")
        if done % cfg.checkpoint_every == 0 or done == total:
            if rank == 0:
                ckpt.save(folder, done, trained.state(), {"total_steps": total, "world_size": world})
            if world > 1:
                dist.barrier()
    elapsed = time.monotonic() - started
    tokens_per_s = round(tokens_seen * world / elapsed, 1) if elapsed else None
    return {
        "summary": _summary(built, total, start, world, tokens_per_s, last),
        "target": built.target,
        "draft": draft,
        "heldout": heldout,
        "rank": rank,
        "built": built,
    }


@dataclass
class _Trained:
    """What a checkpoint keeps of a training: the draft, its optimizer and its learning-rate schedule."""

    draft: Eagle3Draft
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler

    def state(self) -> dict:
        return {
            "draft": ckpt.trained_state(self.draft),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def restore(self, state: dict) -> None:
        ckpt.restore(self.draft, state["draft"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def _resume_or_start(
    cfg: TrainConfig,
    folder: Path,
    rank: int,
    world: int,
    local: torch.device,
    trained: _Trained,
    total: int,
    log,
) -> int:
    """The step training starts from: that of rank 0's newest checkpoint in ``folder``, restored into
    ``trained``, or 0. Rank 0 records the training's settings beside its checkpoints and, starting
    afresh, names the other trainings there."""
    settings = run_settings(cfg, world)
    start, state = resume(folder, rank, world, local)
    if rank == 0:
        if not start:
            for line in other_trainings(folder, settings):
                log(line)
        if not (folder / RUN_SETTINGS).is_file():
            atomic_write_text(folder / RUN_SETTINGS, json.dumps(settings, indent=2) + "\n")
    if state is not None:
        trained.restore(state)
        log(f"resumed from step {start} of {total}")
    return start


def _summary(
    built: Built, total: int, start: int, world: int, tokens_per_s: float | None, last: dict
) -> dict:
    """The run's summary (what eval.json and the manifest report of the training)."""
    setup = built.setup
    return {
        "optimizer_steps": total,
        "resumed_from_step": start,
        "world_size": world,
        "train_rows": len(setup.train_rows),
        "heldout_rows": len(setup.heldout),
        "draft_vocab_size": int(built.draft.d2t.shape[0]),
        "layer_ids": list(built.source.layer_ids),
        "tokens_per_s_this_run": tokens_per_s,
        "precision": setup.precision,
        "attention": built.target.config._attn_implementation if built.target is not None else None,
        "final": last,
        "target_placement": setup.plan.as_dict(),
    }


def _metrics(stats, loss, grad_norm, world: int) -> dict:
    numbers = torch.tensor([loss.item()] + [float(v) for s in stats for v in s[1:]], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(numbers)
        numbers[0] /= world
    accs = [float(numbers[1 + 2 * k] / max(1.0, float(numbers[2 + 2 * k]))) for k in range(len(stats))]
    return {"loss": float(numbers[0]), "acc": accs, "grad_norm": float(grad_norm)}


@torch.no_grad()
def simulated_acceptance(
    source: FeatureSource,
    draft: Eagle3Draft,
    rows,
    steps: int,
    pad_id: int,
    *,
    batch_size: int,
    loss_chunk: int,
    precision: str,
) -> dict:
    """Per-step argmax agreement on held-out rows, and the acceptance length it implies.

    acc_k is measured with teacher-forced tokens; the chain survives to step k with
    probability prod_{j<=k} acc_j, so the expected accepted drafts are the sum of those
    products, and a target forward yields one token more (its own).

    Give training's batch size, loss chunk and precision: this then holds less than a training
    step, which the placement planned, and computes as training did.
    """
    module = DraftLoss(draft, steps, 1.0, loss_chunk)
    correct = torch.zeros(steps, dtype=torch.float64)
    count = torch.zeros(steps, dtype=torch.float64)
    device = draft.fc.weight.device
    for i in range(0, len(rows), batch_size):
        batch = {k: v.to(device) for k, v in collate(rows[i : i + batch_size], pad_id).items()}
        with autocast(precision, device.type):
            target = source(batch["input_ids"], batch["attention_mask"])
            _, stats = module(batch["input_ids"], batch["loss_mask"], target)
        for k, (_, c, n) in enumerate(stats):
            correct[k] += float(c)
            count[k] += float(n)
    acc = (correct / count.clamp(min=1)).tolist()
    survive, accepted = 1.0, 0.0
    for a in acc:
        survive *= a
        accepted += survive
    return {"acc": acc, "accepted_drafts": accepted, "acceptance_length": 1.0 + accepted}
