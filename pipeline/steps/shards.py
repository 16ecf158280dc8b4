"""The tokenize step's shards: written (:class:`ShardWriter`), and read back as rows: those with
assistant tokens, cut at a length, memory-mapped, and held out by a hash of their tokens (train
trains on the rest; accept measures on these).

Parquet is compressed, so it cannot be mapped as it is: the usable rows of the shards are
written once, uncompressed, into an Arrow IPC file (``OUT/rows/<key>.arrow``), which every
process then memory-maps, as nanoGPT maps its token file. A row is a view of its tokens in the
map and a batch is copied out of it by index: about 5 bytes a token (int32 ids, int8 mask) in
the page cache, shared by the ranks of a node and given back under memory pressure, where the
rows as Python lists held about 110 bytes a token of every rank's own memory
(``benchmarks/train_rows_memory.py``).
"""

from __future__ import annotations

import fcntl
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline.contract.atomic import atomic_path
from pipeline.memory.units import MIB
from pipeline.steps.records import tokenized_schema

ROWS_SCHEMA = pa.schema(
    [
        pa.field("input_ids", pa.list_(pa.int32())),
        pa.field("loss_mask", pa.list_(pa.int8())),
        pa.field("source", pa.string()),
    ]
)
"""The memory-mapped rows: the tokenize step's shard types, so converting its shards copies, never widens."""
_CONVERT_ROWS = 64
"""Rows read from a shard at a time while converting: what the conversion holds in memory."""


class ShardWriter:
    """Tables into ``shard-00000.parquet``, ``shard-00001.parquet``, … of ``shard_rows`` rows each."""

    def __init__(self, folder: Path, shard_rows: int):
        self.folder = folder
        self.shard_rows = shard_rows
        self.schema = tokenized_schema()
        self.writer = None
        self.in_shard = 0
        self.shards = 0
        self.rows = 0

    def write(self, table) -> None:
        import pyarrow.parquet as pq

        start = 0
        while start < table.num_rows:
            if self.writer is None or self.in_shard >= self.shard_rows:
                self.close()
                name = self.folder / f"shard-{self.shards:05d}.parquet"
                self.writer = pq.ParquetWriter(str(name), self.schema)
                self.shards += 1
                self.in_shard = 0
            take = min(table.num_rows - start, self.shard_rows - self.in_shard)
            self.writer.write_table(table.slice(start, take))
            self.in_shard += take
            self.rows += take
            start += take

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


@dataclass
class Example:
    input_ids: Sequence[int]
    """A view of the memory-mapped file (a read-only numpy array) for rows from :func:`load_shards`."""
    loss_mask: Sequence[int]
    source: str


def load_shards(path: Path, max_length: int, mapped: Path) -> Rows:
    """Every row of the parquet shards under ``path`` (a folder or one file) that has assistant tokens
    and at least 3 tokens, truncated to ``max_length``, memory-mapped from the Arrow file ``mapped``.

    ``mapped`` is written from the shards when it does not exist: its name must change with the
    shards and ``max_length``. The ranks of a first run wait for the one that converts (a lock
    file beside it), then all map that one file; it is renamed into place whole, so a failed
    conversion leaves none.
    """
    files = sorted(path.rglob("*.parquet")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no .parquet shards under {path}: give --data the tokenize step's shards")
    if not mapped.is_file():
        mapped.parent.mkdir(parents=True, exist_ok=True)
        with open(mapped.with_name(f".{mapped.name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also by a killed process
            if not mapped.is_file():
                _convert(files, max_length, mapped)
    return Rows.open(mapped)


def _convert(files: list[Path], max_length: int, mapped: Path) -> None:
    with atomic_path(mapped) as tmp, pa.OSFile(str(tmp), "wb") as sink:
        with pa.ipc.new_file(sink, ROWS_SCHEMA) as writer:
            for file in files:
                for batch in _usable_rows(file, max_length):
                    writer.write_batch(batch)
    pa.default_memory_pool().release_unused()  # the conversion's buffers, which training never needs


def _usable_rows(file: Path, max_length: int):
    """The rows of one shard as record batches of ROWS_SCHEMA, truncated, unusable rows left out."""
    import pyarrow.parquet as pq

    shard = pq.ParquetFile(file, pre_buffer=False, buffer_size=MIB)
    names = shard.schema_arrow.names
    missing = {"input_ids", "loss_mask"} - set(names)
    if missing:
        raise ValueError(
            f"{file}: missing column(s) {sorted(missing)} (found {names}); "
            "shards need input_ids and loss_mask"
        )
    columns = ["input_ids", "loss_mask"] + (["source"] if "source" in names else [])
    for batch in shard.iter_batches(batch_size=_CONVERT_ROWS, columns=columns):
        yield _usable(batch, file, max_length)


def _usable(batch: pa.RecordBatch, file: Path, max_length: int) -> pa.RecordBatch:
    import pyarrow.compute as pc

    try:
        ids = batch.column("input_ids").cast(ROWS_SCHEMA.field("input_ids").type)
        mask = batch.column("loss_mask").cast(ROWS_SCHEMA.field("loss_mask").type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise ValueError(f"{file}: input_ids must be lists of token ids, loss_mask of 0/1: {exc}") from None
    if ids.null_count or mask.null_count or pc.list_flatten(ids).null_count:
        raise ValueError(f"{file}: a row has a null input_ids or loss_mask, or a null token id")
    lengths = pc.list_value_length(ids).to_numpy()
    mask_lengths = pc.list_value_length(mask).to_numpy()
    for n, m in zip(lengths, mask_lengths, strict=True):
        if n != m:
            raise ValueError(f"{file}: a row has {n} input_ids but {m} loss_mask values")
    ids, mask = pc.list_slice(ids, 0, max_length), pc.list_slice(mask, 0, max_length)
    assistant = np.bincount(
        pc.list_parent_indices(mask).to_numpy(),
        weights=pc.list_flatten(mask).to_numpy().astype(np.float64),
        minlength=len(batch),
    )  # each row's sum of its (truncated) loss mask
    if "source" in batch.schema.names:
        source = pc.fill_null(batch.column("source").cast(pa.string()), "")
    else:
        source = pa.array([""] * len(batch), pa.string())
    rows = pa.RecordBatch.from_arrays([ids, mask, source], schema=ROWS_SCHEMA)
    return rows.filter(pa.array((assistant > 0) & (lengths >= 3)))


@dataclass(frozen=True)
class _Columns:
    """The record batches of a mapped rows file as numpy views: tokens, masks, row offsets; and sources."""

    ids: list[np.ndarray]
    masks: list[np.ndarray]
    offsets: list[np.ndarray]
    sources: list[pa.Array]


class Rows(Sequence[Example]):
    """Rows of a memory-mapped rows file, by index: reading a row copies none of its tokens, and a
    subset (:meth:`take`, a slice) holds three integers a row: its record batch, its index there,
    its token count."""

    def __init__(self, columns: _Columns, batch: np.ndarray, row: np.ndarray, length: np.ndarray):
        self._columns = columns
        self._batch, self._row, self._length = batch, row, length

    @classmethod
    def open(cls, path: Path) -> Rows:
        reader = pa.ipc.open_file(pa.memory_map(str(path)))
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        offsets = [b.column("input_ids").offsets.to_numpy() for b in batches]
        columns = _Columns(
            ids=[b.column("input_ids").values.to_numpy() for b in batches],
            masks=[b.column("loss_mask").values.to_numpy() for b in batches],
            offsets=offsets,
            sources=[b.column("source") for b in batches],
        )
        none = np.zeros(0, np.int64)
        batch = np.concatenate([np.full(b.num_rows, n) for n, b in enumerate(batches)] or [none])
        row = np.concatenate([np.arange(b.num_rows) for b in batches] or [none])
        length = np.concatenate([np.diff(o) for o in offsets] or [none]).astype(np.int64)
        return cls(columns, batch, row, length)

    def __len__(self) -> int:
        return len(self._row)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.take(np.arange(*i.indices(len(self))))
        b, r = self._batch[i], self._row[i]
        start, end = self._columns.offsets[b][r : r + 2]
        return Example(
            self._columns.ids[b][start:end],
            self._columns.masks[b][start:end],
            self._columns.sources[b][r].as_py(),
        )

    def take(self, indices: np.ndarray) -> Rows:
        """These rows, in this order."""
        return Rows(self._columns, self._batch[indices], self._row[indices], self._length[indices])

    def lengths(self) -> np.ndarray:
        """Each row's token count."""
        return self._length

    def largest_token(self) -> int:
        return max(int(row.input_ids.max()) for row in self)


def _heldout_bucket(input_ids: Sequence[int]) -> float:
    # The hash of the tokens' list as Python prints it: the split every earlier run made, so a run
    # resumed across versions keeps its rows (and its batches).
    digest = hashlib.sha256(str(np.asarray(input_ids).tolist()).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_heldout(rows: Rows, fraction: float) -> tuple[Rows, Rows]:
    """Hold out rows by a hash of their tokens: stable whatever the shard order."""
    held = np.array([_heldout_bucket(row.input_ids) < fraction for row in rows], dtype=bool)
    return rows.take(np.flatnonzero(~held)), rows.take(np.flatnonzero(held))
