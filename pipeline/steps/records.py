"""The record formats steps hand each other (DESIGN.md, "Data formats"): how a record's ``id`` and
``source_id`` are made, and the columns of a tokenized file. prep writes them, tokenize keeps them
or, for a pre-tokenized file prep did not write, makes them the same way."""

from __future__ import annotations

import hashlib
import json

HELDOUT_FRACTION = 0.05
"""The share of tokenized rows held out by default (``shards.split_heldout``): train evaluates on
them, and accept measures on the same ones."""
MAX_LENGTH = 2048
"""Rows are cut to this many tokens by default, by tokenize, in training and in accept alike: a row
tokenize keeps is the row training reads, and accept finds the rows training held out."""
POSITION_PREFIX = "#"
"""Starts the ``source_id`` of a row without an id of its own, before its index in the source."""


def position_id(index: int) -> str:
    """The ``source_id`` of the row at ``index`` in its source, for a row without an id of its own."""
    return f"{POSITION_PREFIX}{index}"


def record_id(source_name: str, content: str) -> str:
    """A record's ``id``: a stable hash of its source and its content."""
    return hashlib.sha256(f"{source_name}\0{content}".encode()).hexdigest()[:32]


def tokens_key(input_ids: list[int], loss_mask: list[int]) -> str:
    """The content of a tokenized row, hashed: its dedup key, and the content its ``id`` hashes."""
    payload = json.dumps([input_ids, loss_mask]).encode()
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def tokenized_schema(part: bool = False):
    """The columns of a tokenized file (prep's ``native_tokenized.parquet``, tokenize's shards); a
    prep part adds ``key`` and ``position``."""
    import pyarrow as pa

    fields = [
        pa.field("input_ids", pa.list_(pa.int32())),
        pa.field("loss_mask", pa.list_(pa.int8())),
        pa.field("source", pa.string()),
        pa.field("id", pa.string()),
        pa.field("source_id", pa.string()),
    ]
    if part:
        fields += [pa.field("key", pa.string()), pa.field("position", pa.int64())]
    return pa.schema(fields)
