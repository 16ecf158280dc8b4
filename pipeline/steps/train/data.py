"""Training's batches: the rows (``steps/shards.py``) padded into batches, in an order that is a
pure function of (seed, epoch).

Because the order is reproducible, the data position after a resume is just the optimizer step
count: no iterator state needs saving.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from pipeline.steps.shards import Example


def token_counts(rows: Sequence[Example], vocab_size: int) -> torch.Tensor:
    """How often each token (ids below ``vocab_size``) occurs among loss-masked (assistant) tokens."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for row in rows:
        np.add.at(counts, np.asarray(row.input_ids)[np.asarray(row.loss_mask) != 0], 1)
    return torch.from_numpy(counts)


@functools.lru_cache(maxsize=2)
def epoch_order(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return tuple(torch.randperm(n, generator=generator).tolist())


def collate(rows: Sequence[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``loss_mask`` tensors: the batch's only copy."""
    width = max(len(r.input_ids) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    attention = np.zeros((len(rows), width), dtype=np.int64)
    loss = np.zeros((len(rows), width), dtype=bool)
    for i, r in enumerate(rows):
        n = len(r.input_ids)
        ids[i, :n] = r.input_ids
        attention[i, :n] = 1
        loss[i, :n] = np.asarray(r.loss_mask) != 0
    return {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(attention),
        "loss_mask": torch.from_numpy(loss),
    }


def batch_at(rows: Sequence[Example], step: int, batch_size: int, seed: int, rank: int, world: int):
    """The rows rank ``rank`` trains on at global step ``step`` (each step takes batch_size*world rows)."""
    epoch, index = divmod(step, steps_per_epoch(len(rows), batch_size, world))
    order = epoch_order(len(rows), seed, epoch)
    start = index * batch_size * world + rank * batch_size
    return [rows[i] for i in order[start : start + batch_size]]


def steps_per_epoch(n_rows: int, batch_size: int, world: int) -> int:
    """Whole steps in one pass over the rows; every rank's batch is full."""
    if n_rows < batch_size * world:
        # Some rank would get fewer rows than its batch, or none at all.
        raise ValueError(
            f"{n_rows} training rows are fewer than one optimizer step takes (batch size {batch_size} "
            f"x {world} processes): lower --batch-size or --nproc, or give more data"
        )
    return n_rows // (batch_size * world)
