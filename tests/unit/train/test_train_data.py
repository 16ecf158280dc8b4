"""Rows and batches: the shards memory-mapped, batches built by index exactly as they were from
Python lists, every rank's batch full at every step, or a clear error before training starts."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.contract.exits import EXIT_BAD_INPUT
from pipeline.steps import shards as shards_module
from pipeline.steps.shards import ROWS_SCHEMA, Example, load_shards, split_heldout
from pipeline.steps.train.cli import train_command
from pipeline.steps.train.data import (
    TokenBatches,
    batch_at,
    collate,
    steps_per_epoch,
    token_batches,
    token_counts,
)
from pipeline.steps.train.loop import TrainConfig, rows_file


def rows(n: int) -> list[Example]:
    return [Example([2, 3, 4 + i], [0, 1, 1], "") for i in range(n)]


@pytest.mark.parametrize(("n", "batch_size", "world"), [(4, 2, 2), (7, 2, 3), (9, 4, 1)])
def test_each_step_gives_every_rank_a_full_batch_of_its_own(n, batch_size, world):
    data = rows(n)
    for step in range(3 * steps_per_epoch(n, batch_size, world)):
        batches = [batch_at(data, step, batch_size, 0, rank, world) for rank in range(world)]
        assert all(len(batch) == batch_size for batch in batches)
        taken = [id(row) for batch in batches for row in batch]
        assert len(set(taken)) == len(taken)


def test_fewer_rows_than_one_step_takes_is_an_error_not_an_empty_batch():
    with pytest.raises(ValueError, match=r"^3 training rows are fewer than one optimizer step takes "):
        steps_per_epoch(3, 2, 2)
    with pytest.raises(ValueError, match=r"batch size 2 x 2 processes"):
        batch_at(rows(2), 0, 2, 0, rank=1, world=2)


def test_the_step_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).save_pretrained(tmp_path / "target")
    (tmp_path / "shards").mkdir()
    pq.write_table(
        pa.table({"input_ids": [[5, 6, 7, 8]] * 3, "loss_mask": [[0, 1, 1, 1]] * 3}),
        tmp_path / "shards" / "shard-00000.parquet",
    )
    monkeypatch.setenv("EYRIE_STEP_DIR", str(tmp_path / "step"))
    code = train_command(
        None, data=tmp_path / "shards", target=tmp_path / "target", batch_size=4, heldout_fraction=0.0
    )
    assert code == EXIT_BAD_INPUT
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert said == [
        "error: 3 training rows are fewer than one optimizer step takes (batch size 4 x 1 processes): "
        "lower --batch-size or --nproc, or give more data"
    ]


MAX_LENGTH = 12


def write_odd_shards(root: Path) -> Path:
    """Two shards (one in a subfolder) of the tokenize step's types and of Python's inferred ones
    (int64, no source column), with every kind of row the loader drops or cuts."""
    generator = np.random.default_rng(3)

    def tokens(n: int) -> list[int]:
        return generator.integers(2, 500, n).tolist()

    ids = [tokens(9), tokens(30), tokens(20), tokens(8), [7, 8], tokens(16), tokens(9)]
    masks = [
        [0, 0, 0, 1, 1, 1, 1, 1, 1],
        [0] * 5 + [1] * 25,  # cut at MAX_LENGTH
        [0] * 15 + [1] * 5,  # its assistant tokens lie past MAX_LENGTH: dropped
        [0] * 8,  # no assistant token: dropped
        [0, 1],  # fewer than 3 tokens: dropped
        [0] * 4 + [1] * 12,
        [0, 0, 0, 1, 1, 1, 1, 1, 1],
    ]
    ids[6] = ids[0]  # the same tokens twice
    shards = root / "shards"
    (shards / "more").mkdir(parents=True)
    typed = pa.table(
        {
            "input_ids": pa.array(ids[:4], pa.list_(pa.int32())),
            "loss_mask": pa.array(masks[:4], pa.list_(pa.int8())),
            "source": pa.array(["a", None, "c", "d"]),
        }
    )
    pq.write_table(typed, shards / "shard-00000.parquet")
    more = [tokens(n) for n in (14, 10, 13, 11)]
    plain = pa.table(
        {
            "input_ids": ids[4:] + more,
            "loss_mask": masks[4:] + [[0, 0] + [1] * (len(m) - 2) for m in more],
        }
    )
    pq.write_table(plain, shards / "more" / "shard-00001.parquet")
    return shards


def rows_as_python_lists(shards: Path, max_length: int) -> list[Example]:
    """What training read before the rows were memory-mapped: every row's tokens as Python lists."""
    rows = []
    for file in sorted(shards.rglob("*.parquet")):
        table = pq.read_table(file)
        sources = table.column("source").to_pylist() if "source" in table.column_names else None
        for n, (ids, mask) in enumerate(
            zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist(), strict=True)
        ):
            if sum(mask[:max_length]) > 0 and len(ids) >= 3:
                rows.append(
                    Example(ids[:max_length], mask[:max_length], (sources[n] if sources else "") or "")
                )
    return rows


def test_batches_built_by_index_equal_the_ones_built_from_python_lists(tmp_path):
    shards = write_odd_shards(tmp_path)
    rows = load_shards(shards, MAX_LENGTH, tmp_path / "rows" / "mapped.arrow")
    reference = rows_as_python_lists(shards, MAX_LENGTH)
    assert len(rows) == len(reference) == 8
    for row, expected in zip(rows, reference, strict=True):
        assert (
            isinstance(row.input_ids, np.ndarray) and not row.input_ids.flags.writeable
        )  # a view of the map
        assert (row.input_ids.tolist(), row.loss_mask.tolist(), row.source) == (
            expected.input_ids,
            expected.loss_mask,
            expected.source,
        )
    assert rows.lengths().tolist() == [len(r.input_ids) for r in reference]
    assert rows.largest_token() == max(max(r.input_ids) for r in reference)

    def bucket(row: Example) -> float:  # the held-out split as it has always been made
        return int.from_bytes(hashlib.sha256(str(row.input_ids).encode()).digest()[:8], "big") / 2**64

    train, heldout = split_heldout(rows, 0.3)
    expected_train = [r for r in reference if bucket(r) >= 0.3]
    assert [r.input_ids.tolist() for r in heldout] == [r.input_ids for r in reference if bucket(r) < 0.3]
    assert [r.input_ids.tolist() for r in train] == [r.input_ids for r in expected_train]
    assert len(heldout) == 2 and [r.input_ids.tolist() for r in rows[1:3]] == [
        r.input_ids for r in reference[1:3]
    ]

    assert torch.equal(
        token_counts(train, 500),
        sum(
            torch.bincount(
                torch.tensor(r.input_ids)[torch.tensor(r.loss_mask, dtype=torch.bool)], minlength=500
            )
            for r in expected_train
        ),
    )
    for step in range(3 * steps_per_epoch(len(train), 2, 2)):
        for rank in range(2):
            got = collate(batch_at(train, step, 2, 7, rank, 2), pad_id=3)
            want = collate(batch_at(expected_train, step, 2, 7, rank, 2), pad_id=3)
            assert got.keys() == want.keys()
            for key in got:
                assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (step, key)


def test_the_rows_file_is_written_once_and_keyed_by_the_shards_and_the_length(tmp_path, monkeypatch):
    shards = write_odd_shards(tmp_path)
    cfg = TrainConfig(data=shards, target=tmp_path, out_dir=tmp_path / "out", max_length=MAX_LENGTH)
    mapped = rows_file(cfg)
    assert mapped.parent == tmp_path / "out" / "rows"
    first = load_shards(shards, MAX_LENGTH, mapped)
    reader = pa.ipc.open_file(mapped)
    assert reader.schema == ROWS_SCHEMA
    assert all(reader.get_batch(i).column("input_ids").values.type == pa.int32() for i in range(2))
    assert sorted(p.name for p in mapped.parent.iterdir()) == [f".{mapped.name}.lock", mapped.name]

    def never(*args):
        raise AssertionError("the shards were converted again")

    monkeypatch.setattr(shards_module, "_usable_rows", never)
    again = load_shards(shards, MAX_LENGTH, mapped)
    assert [r.input_ids.tolist() for r in again] == [r.input_ids.tolist() for r in first]

    assert rows_file(cfg.model_copy(update={"max_length": MAX_LENGTH + 1})) != mapped
    table = pq.read_table(shards / "shard-00000.parquet")
    pq.write_table(table.slice(1), shards / "shard-00000.parquet")
    assert rows_file(cfg) != mapped


@pytest.mark.parametrize(
    ("columns", "said"),
    [
        (
            {"input_ids": [[5, 6, 7, 8]], "loss_mask": [[0, 1, 1]]},
            "a row has 4 input_ids but 3 loss_mask values",
        ),
        ({"input_ids": [[5, 6, 7, 8]]}, "missing column(s) ['loss_mask'] (found ['input_ids']); shards need"),
        (
            {"input_ids": [[5, 6, 2**40]], "loss_mask": [[0, 1, 1]]},
            "input_ids must be lists of token ids, loss_mask of 0/1: Integer value 1099511627776",
        ),
        ({"input_ids": [[5, 6, 7], None], "loss_mask": [[0, 1, 1], [1]]}, "a row has a null input_ids"),
    ],
)
def test_a_shard_it_cannot_use_is_one_line_naming_it_and_leaves_no_rows_file(tmp_path, columns, said):
    (tmp_path / "shards").mkdir()
    good = {"input_ids": [[5, 6, 7]], "loss_mask": [[0, 1, 1]]}
    pq.write_table(pa.table(good), tmp_path / "shards" / "a.parquet")  # converted before the bad one
    bad = tmp_path / "shards" / "b.parquet"
    pq.write_table(pa.table(columns), bad)
    mapped = tmp_path / "rows" / "mapped.arrow"
    with pytest.raises(ValueError) as refused:
        load_shards(tmp_path / "shards", 8, mapped)
    assert str(refused.value).startswith(f"{bad}: {said}")
    assert "\n" not in str(refused.value)
    assert [p.name for p in mapped.parent.iterdir()] == [f".{mapped.name}.lock"]  # no rows file, whole or not


_HOLD = """
import json, sys
from pathlib import Path
import pipeline.steps.train.loop
from pipeline.steps.shards import load_shards

def anonymous():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024

shards, mapped, warm = map(Path, sys.argv[1:4])
load_shards(warm, 4096, warm.with_suffix(".arrow"))  # what a module's first use costs is not the rows'
before = anonymous()
rows = load_shards(shards, 4096, mapped)
tokens = sum(len(row.input_ids) + len(row.loss_mask) for row in rows) // 2  # every row read
print(json.dumps({"tokens": tokens, "grew": anonymous() - before}))
"""


@pytest.mark.timeout(300)
def test_a_process_holding_a_million_tokens_holds_them_in_the_map_not_in_its_own_memory(tmp_path):
    """As Python lists the rows took ~100 bytes a token of the process's own memory; mapped, its
    anonymous memory barely moves (the tokens are file pages, shared by a node's ranks)."""
    ids = np.random.default_rng(0).integers(2, 163840, (1000, 1000), dtype=np.int32)
    for name, rows in (("shards", ids), ("warm", ids[:4])):
        (tmp_path / name).mkdir()
        table = pa.table(
            {
                "input_ids": pa.array(list(rows), pa.list_(pa.int32())),
                "loss_mask": pa.array([np.ones(rows.shape[1], np.int8)] * len(rows), pa.list_(pa.int8())),
            }
        )
        pq.write_table(table, tmp_path / name / "shard-00000.parquet")
    mapped = tmp_path / "rows.arrow"
    load_shards(tmp_path / "shards", 4096, mapped)  # converted here, mapped there
    hold = subprocess.run(
        [sys.executable, "-c", _HOLD, str(tmp_path / "shards"), str(mapped), str(tmp_path / "warm")],
        capture_output=True,
        text=True,
        check=True,
        timeout=240,
    )
    held = json.loads(hold.stdout.splitlines()[-1])
    assert held["tokens"] == 1_000_000
    assert held["grew"] < 2 * held["tokens"], f"{held['grew'] / held['tokens']:.1f} bytes a token"


_RANK = """
import os, sys, time
from pathlib import Path
from pipeline.steps.shards import load_shards

shards, mapped, go = map(Path, sys.argv[1:4])
print("ready", flush=True)
while not go.exists():
    time.sleep(0.005)
rows = load_shards(shards, 4096, mapped)
maps = Path("/proc/self/maps").read_text().splitlines()
print(sorted({int(line.split()[4]) for line in maps if line.split()[-1] == str(mapped)}), len(rows))
"""


@pytest.mark.timeout(300)
def test_ranks_that_start_together_convert_once_and_map_the_same_file(tmp_path):
    """A rank that converted a copy of its own and mapped it would hold the rows apart from the
    others (in the page cache once per copy) after another rank's copy replaced it."""
    ids = np.random.default_rng(1).integers(2, 163840, (2000, 1000), dtype=np.int32)
    (tmp_path / "shards").mkdir()
    table = pa.table(
        {
            "input_ids": pa.array(list(ids), pa.list_(pa.int32())),
            "loss_mask": pa.array([np.ones(1000, np.int8)] * 2000, pa.list_(pa.int8())),
        }
    )
    pq.write_table(table, tmp_path / "shards" / "shard-00000.parquet")
    mapped, go = tmp_path / "rows" / "mapped.arrow", tmp_path / "go"
    argv = [sys.executable, "-c", _RANK, str(tmp_path / "shards"), str(mapped), str(go)]
    ranks = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(4)]
    assert [rank.stdout.readline() for rank in ranks] == ["ready\n"] * 4
    go.touch()
    said = [rank.communicate(timeout=240)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0] * 4
    assert said == [f"[{mapped.stat().st_ino}] 2000\n"] * 4


def rows_of_lengths(lengths: list[int]) -> list[Example]:
    return [Example(list(range(n)), [0] + [1] * (n - 1), "") for n in lengths]


def test_token_batches_take_as_many_rows_as_fit_the_budget_padded():
    # A 30k-token row goes alone; a hundred rows of 300 go together, padded to their widest.
    lengths = [300] * 150 + [30_000] + [280] * 10
    batches = token_batches(lengths, list(range(len(lengths))), 32_768)
    assert [len(b) for b in batches] == [109, 41, 1, 10]
    for batch in batches:
        assert max(lengths[i] for i in batch) * len(batch) <= 32_768
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    # A row longer than the budget still goes, alone (training cuts rows to it before).
    assert token_batches([10, 50, 10], [0, 1, 2], 40) == [[0], [1], [2]]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_rank_gets_its_own_token_batch_and_every_row_once_an_epoch(world):
    data = rows_of_lengths([3 + (i * 7) % 40 for i in range(60)])
    batches = TokenBatches(data, 64, seed=5, world=world)
    per_epoch = batches.steps_per_epoch()
    for epoch in range(2):
        seen = []
        for step in range(epoch * per_epoch, (epoch + 1) * per_epoch):
            taken = [batches.at(step, rank) for rank in range(world)]
            assert all(max(len(r.input_ids) for r in batch) * len(batch) <= 64 for batch in taken)
            seen += [id(row) for batch in taken for row in batch]
        assert len(set(seen)) == len(seen)  # no row twice in an epoch
        assert len(seen) >= len(data) - 64  # at most the batches left over by the world size are skipped


def test_too_few_token_batches_for_the_processes_is_an_error():
    with pytest.raises(
        ValueError, match=r"make 1 batch\(es\) of at most 64 tokens, fewer than one optimizer step"
    ):
        TokenBatches(rows_of_lengths([5, 5, 5]), 64, seed=0, world=2)


def test_a_token_budget_and_a_row_count_are_not_given_together():
    with pytest.raises(ValueError, match="give --batch-size .* or --batch-tokens .*, not both"):
        TrainConfig(data=Path("d"), target=Path("t"), batch_size=2, batch_tokens=4096)
    config = TrainConfig(data=Path("d"), target=Path("t"), batch_tokens=1024, max_length=4096)
    assert config.row_limit == 1024  # rows longer than the budget are cut to it
    assert TrainConfig(data=Path("d"), target=Path("t"), batch_tokens=0).batch_tokens is None
