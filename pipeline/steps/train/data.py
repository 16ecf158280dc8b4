"""Training's batches: the rows (``steps/shards.py``) padded into batches, in an order that is a
pure function of (seed, epoch).

A batch is ``batch_size`` rows, or, with a token budget, as many rows as fit it padded: a 30k-token
row alone, a hundred rows of 300 together. Because the order is reproducible, the data position
after a resume is just the optimizer step count: no iterator state needs saving.
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


def token_batches(lengths: Sequence[int], order: Sequence[int], budget: int) -> list[list[int]]:
    """The rows of ``order`` in consecutive batches, each as many as fit ``budget`` tokens padded to
    its widest row (a row longer than the budget alone)."""
    batches: list[list[int]] = []
    batch: list[int] = []
    widest = 0
    for index in order:
        wider = max(widest, lengths[index])
        if batch and wider * (len(batch) + 1) > budget:
            batches.append(batch)
            batch, wider = [], lengths[index]
        batch.append(index)
        widest = wider
    return batches + [batch] if batch else batches


class TokenBatches:
    """Batches of rows up to a token budget, laid out once (in the seed's order of the rows) and
    taken in a new order of the batches each epoch, so every epoch has as many steps."""

    def __init__(self, rows: Sequence[Example], budget: int, seed: int, world: int):
        lengths = [len(row.input_ids) for row in rows]
        self.rows, self.seed, self.world = rows, seed, world
        self.batches = token_batches(lengths, epoch_order(len(rows), seed, 0), budget)
        if len(self.batches) < world:
            raise ValueError(
                f"{len(rows)} training rows make {len(self.batches)} batch(es) of at most {budget} tokens, "
                f"fewer than one optimizer step takes ({world} processes): lower --batch-tokens or --nproc, "
                "or give more data"
            )

    def steps_per_epoch(self) -> int:
        return len(self.batches) // self.world

    def at(self, step: int, rank: int) -> list[Example]:
        """The rows rank ``rank`` trains on at global step ``step``."""
        epoch, index = divmod(step, self.steps_per_epoch())
        order = epoch_order(len(self.batches), self.seed, epoch)
        return [self.rows[i] for i in self.batches[order[index * self.world + rank]]]


class RowBatches:
    """Batches of ``batch_size`` rows: a new order of the rows each epoch."""

    def __init__(self, rows: Sequence[Example], batch_size: int, seed: int, world: int):
        self.rows, self.batch_size, self.seed, self.world = rows, batch_size, seed, world
        self.per_epoch = steps_per_epoch(len(rows), batch_size, world)

    def steps_per_epoch(self) -> int:
        return self.per_epoch

    def at(self, step: int, rank: int) -> list[Example]:
        return batch_at(self.rows, step, self.batch_size, self.seed, rank, self.world)


def steps_per_epoch(n_rows: int, batch_size: int, world: int) -> int:
    """Whole steps in one pass over the rows; every rank's batch is full."""
    if n_rows < batch_size * world:
        # Some rank would get fewer rows than its batch, or none at all.
        raise ValueError(
            f"{n_rows} training rows are fewer than one optimizer step takes (batch size {batch_size} "
            f"x {world} processes): lower --batch-size or --nproc, or give more data"
        )
    return n_rows // (batch_size * world)
