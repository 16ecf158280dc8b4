"""Batches: every rank's batch full at every step, or a clear error before training starts."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.steps.train.cli import EXIT_BAD_INPUT, train_command
from pipeline.steps.train.data import Example, batch_at, steps_per_epoch


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
        LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                    num_attention_heads=2, num_key_value_heads=1)
    ).save_pretrained(tmp_path / "target")  # fmt: skip
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
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("eyrie train:")]
    assert said == [
        "eyrie train: 3 training rows are fewer than one optimizer step takes (batch size 4 x 1 processes): "
        "lower --batch-size or --nproc, or give more data"
    ]
