"""Tokenized shards in, padded batches out, in an order that is a pure function of (seed, epoch).

Because the order is reproducible, the data position after a resume is just the
optimizer step count: no iterator state needs saving.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[int]
    source: str


def load_shards(path: Path, max_length: int) -> list[Example]:
    """Every row of the parquet shards under ``path`` (a folder or one file), truncated to ``max_length``."""
    import pyarrow.parquet as pq

    files = sorted(path.rglob("*.parquet")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no .parquet shards under {path}: give --data the tokenize step's shards")
    rows: list[Example] = []
    for file in files:
        table = pq.read_table(file)
        missing = {"input_ids", "loss_mask"} - set(table.column_names)
        if missing:
            raise ValueError(
                f"{file}: missing column(s) {sorted(missing)} (found {table.column_names}); "
                "shards need input_ids and loss_mask"
            )
        ids = table.column("input_ids").to_pylist()
        masks = table.column("loss_mask").to_pylist()
        sources = table.column("source").to_pylist() if "source" in table.column_names else [""] * len(ids)
        for i, m, s in zip(ids, masks, sources, strict=True):
            if len(i) != len(m):
                raise ValueError(f"{file}: a row has {len(i)} input_ids but {len(m)} loss_mask values")
            if sum(m[:max_length]) > 0 and len(i) >= 3:
                rows.append(Example(i[:max_length], m[:max_length], s or ""))
    return rows


def split_heldout(rows: list[Example], fraction: float) -> tuple[list[Example], list[Example]]:
    """Hold out rows by a hash of their tokens: stable whatever the shard order."""

    def bucket(row: Example) -> float:
        digest = hashlib.sha256(str(row.input_ids).encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64

    train = [r for r in rows if bucket(r) >= fraction]
    heldout = [r for r in rows if bucket(r) < fraction]
    return train, heldout


def token_counts(rows: list[Example], vocab_size: int) -> torch.Tensor:
    """How often each token occurs among loss-masked (assistant) tokens."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in rows:
        ids = torch.tensor(row.input_ids)[torch.tensor(row.loss_mask, dtype=torch.bool)]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


@functools.lru_cache(maxsize=2)
def epoch_order(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return tuple(torch.randperm(n, generator=generator).tolist())


def collate(rows: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``loss_mask`` tensors."""
    width = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    loss = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        n = len(r.input_ids)
        ids[i, :n] = torch.tensor(r.input_ids)
        attention[i, :n] = 1
        loss[i, :n] = torch.tensor(r.loss_mask, dtype=torch.bool)
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss}


def batch_at(rows: list[Example], step: int, batch_size: int, seed: int, rank: int, world: int):
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
