"""The offline placement's features pass: the target runs once over the rows, its features go to disk.

For every token the pass keeps the outputs of the three feature layers and the last hidden state
(the final norm's output, which the lm_head reads), in the target's dtype::

    bytes per token = 4 x hidden x bytes per element     (bf16, hidden 7168: 4 x 7168 x 2 = 57,344 B)

Layout of the pass's folder (``FEATURES/<key>/``, the key naming the target, the rows, the layers
and the dtype)::

    shard-00000.safetensors ...  aux (tokens, 3H), last (tokens, H), offsets (rows + 1), digests (rows, 32)
    index.json                   written last: the pass is complete when it exists

Each shard is written under a temporary name and renamed into place, so a killed pass leaves whole
shards only (and the temporary file of the shard it was writing, which the rerun removes); a rerun
checks the disk for what is left and writes the missing shards. Rows are found by the sha256 of
their token ids, so any batch order reads them back.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipeline.contract.atomic import atomic_path, atomic_write_text, final_name_of
from pipeline.memory.units import MIB, format_size
from pipeline.steps.shards import Example
from pipeline.steps.train.data import collate

INDEX = "index.json"
_SHARD_NAME = "shard-{:05d}.safetensors"
_SHARD = re.compile(r"^shard-\d{5}\.safetensors$")
SHARD_BYTES = 256 * MIB
"""Features per shard file: large enough to read sequentially, small enough that a kill loses little."""


def row_digest(input_ids: Sequence[int]) -> bytes:
    return hashlib.sha256(np.asarray(input_ids, dtype=np.int64).tobytes()).digest()


def bytes_per_token(hidden_size: int, dtype: torch.dtype) -> int:
    """Three feature layers and the last hidden state, ``hidden_size`` wide each, in ``dtype``."""
    return 4 * hidden_size * (torch.finfo(dtype).bits // 8)


def _shards(rows: Sequence[Example], per_token: int) -> list[list[int]]:
    """Consecutive groups of the distinct rows (their indices), each at most SHARD_BYTES of features
    (or one row)."""
    seen: set[bytes] = set()
    groups: list[list[int]] = [[]]
    size = 0
    for i, row in enumerate(rows):
        digest = row_digest(row.input_ids)
        if digest in seen:
            continue
        seen.add(digest)
        need = len(row.input_ids) * per_token
        if groups[-1] and size + need > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += need
    return groups


class FeaturesError(ValueError):
    """The features pass cannot run (too little disk) or its folder does not hold these rows: one line."""


def _check_disk(folder: Path, tokens: int, hidden_size: int, dtype: torch.dtype) -> None:
    element = torch.finfo(dtype).bits // 8
    needed = tokens * bytes_per_token(hidden_size, dtype)
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise FeaturesError(
            f"offline features need {format_size(needed)} more in {folder} ({tokens:,} tokens x 4 x "
            f"{hidden_size} x {element} bytes), which has {format_size(free)} free: free space, give "
            "--features-dir a larger disk, or use --target-placement sharded"
        )


@dataclass
class PendingPass:
    """A pass's shards (groups of rows), and those still to write."""

    folder: Path
    hidden_size: int
    dtype: torch.dtype
    rows: Sequence[Example]
    groups: list[list[int]]
    """Each shard's rows, by their index in ``rows``."""
    missing: list[int]

    @property
    def names(self) -> list[str]:
        return [_SHARD_NAME.format(i) for i in range(len(self.groups))]

    def tokens(self, shards) -> int:
        return sum(len(self.rows[r].input_ids) for i in shards for r in self.groups[i])


def pending_pass(rows: Sequence[Example], folder: Path, hidden_size: int, dtype: torch.dtype) -> PendingPass:
    """What a pass over ``rows`` still has to write in ``folder``, once the disk is known to hold it
    (checked before the target is loaded, with the arithmetic in the error). A killed pass's shard in
    progress is removed (one process writes a pass)."""
    folder.mkdir(parents=True, exist_ok=True)
    for leftover in (p for p in folder.iterdir() if _SHARD.match(final_name_of(p.name) or "")):
        leftover.unlink()
    groups = _shards(rows, bytes_per_token(hidden_size, dtype))
    missing = [i for i in range(len(groups)) if not (folder / _SHARD_NAME.format(i)).is_file()]
    pending = PendingPass(folder, hidden_size, dtype, rows, groups, missing)
    _check_disk(folder, pending.tokens(missing), hidden_size, dtype)
    return pending


def write_features(
    hidden: Callable[[torch.Tensor, torch.Tensor, torch.device], tuple[torch.Tensor, torch.Tensor]],
    pending: PendingPass,
    layer_ids: list[int],
    batch_size: int,
    pad_id: int,
    log: Callable[[str], None],
) -> None:
    """Run ``hidden`` (the target: ``(input_ids, attention_mask, device) -> (features, last)``) over the
    rows of the shards still to write, ``batch_size`` at a time, and write them, then the index."""
    folder, groups, missing, dtype = pending.folder, pending.groups, pending.missing, pending.dtype
    rows = pending.rows
    names = pending.names
    per_token = bytes_per_token(pending.hidden_size, dtype)
    total, left = pending.tokens(range(len(groups))), pending.tokens(missing)
    log(
        f"features pass: {sum(map(len, groups)):,} rows, {total:,} tokens x {per_token:,} bytes = "
        f"{format_size(total * per_token)} in {len(groups)} shards under {folder}"
        + (f" ({len(groups) - len(missing)} already written)" if len(missing) < len(groups) else "")
    )
    started, done = time.monotonic(), 0
    for i in missing:
        group = [rows[r] for r in groups[i]]
        aux, last = [], []
        for start in range(0, len(group), batch_size):
            part = group[start : start + batch_size]
            batch = collate(part, pad_id)
            features, final = hidden(batch["input_ids"], batch["attention_mask"], torch.device("cpu"))
            for j, row in enumerate(part):
                n = len(row.input_ids)
                aux.append(features[j, :n].to(dtype))
                last.append(final[j, :n].to("cpu", dtype))
        lengths = torch.tensor([len(r.input_ids) for r in group])
        tensors = {
            "aux": torch.cat(aux).contiguous(),
            "last": torch.cat(last).contiguous(),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
            "digests": torch.tensor([list(row_digest(r.input_ids)) for r in group], dtype=torch.uint8),
        }
        with atomic_path(folder / names[i]) as tmp:
            save_file(tensors, tmp)
        done += int(lengths.sum())
        rate = done / max(time.monotonic() - started, 1e-9)
        log(f"features pass: shard {i + 1}/{len(groups)} written ({done:,}/{left:,} tokens, {rate:,.0f}/s)")
    index = {
        "layer_ids": list(layer_ids),
        "hidden_size": pending.hidden_size,
        "dtype": str(dtype).removeprefix("torch."),
        "bytes_per_token": per_token,
        "rows": sum(map(len, groups)),
        "tokens": total,
        "shards": names,
    }
    atomic_write_text(folder / INDEX, json.dumps(index, indent=2) + "\n")


def is_complete(folder: Path) -> bool:
    return (folder / INDEX).is_file()


class FeatureShards:
    """A complete pass, memory-mapped: one row's features by the digest of its tokens."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = json.loads((folder / INDEX).read_text())
        self.layer_ids: list[int] = index["layer_ids"]
        self.hidden_size: int = index["hidden_size"]
        self.dtype: torch.dtype = getattr(torch, index["dtype"])
        self._files = [safe_open(folder / name, framework="pt") for name in index["shards"]]
        self._where: dict[bytes, tuple[int, int, int]] = {}
        for n, shard in enumerate(self._files):
            offsets = shard.get_tensor("offsets").tolist()
            for r, digest in enumerate(shard.get_tensor("digests").numpy()):
                self._where[digest.tobytes()] = (n, offsets[r], offsets[r + 1])

    def row(self, digest: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        """(features (n, 3H), last hidden state (n, H)) of the row whose tokens have ``digest``."""
        try:
            n, start, end = self._where[digest]
        except KeyError:
            raise FeaturesError(
                f"a row has no features in {self.folder}: its pass saw other rows; remove it to run it again"
            ) from None
        shard = self._files[n]
        return shard.get_slice("aux")[start:end], shard.get_slice("last")[start:end]
