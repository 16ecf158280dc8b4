"""What names a training's outputs and how many processes it runs: a hub-id target's offline features
are keyed on its snapshot, a sharded target trains in one process, and a rerun that cannot resume
(a setting changed) says which setting."""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.steps import target as target_module
from pipeline.steps.train.launch import placement_for_launch
from pipeline.steps.train.loop import TrainConfig, train
from pipeline.steps.train.offline import is_complete

HUB_ID = "eyrie-tests/tiny-llama"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target's folder and a folder of training shards for it."""
    root = tmp_path_factory.mktemp("keys")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=1,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(root / "target")
    generator = torch.Generator().manual_seed(2)
    rows = {"input_ids": [], "loss_mask": []}
    for i in range(16):
        n = 20 + i % 7
        rows["input_ids"].append(torch.randint(2, 128, (n,), generator=generator).tolist())
        rows["loss_mask"].append([0] * 6 + [1] * (n - 6))
    (root / "shards").mkdir()
    pq.write_table(pa.table(rows), root / "shards" / "shard-00000.parquet")
    return root


def _hub_cache(cache, target, commit: str) -> None:
    """``target``'s files as the Hugging Face cache holds a snapshot of HUB_ID at ``commit``."""
    repo = cache / ("models--" + HUB_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in target.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)


def test_offline_training_of_a_hub_id_target_keys_its_features_on_the_snapshot(tiny, tmp_path):
    cache = tmp_path / "hub"
    _hub_cache(cache, tiny / "target", "a" * 40)
    step = tmp_path / "step"
    step.mkdir()
    argv = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "train",
        "--data",
        str(tiny / "shards"),
        "--target",
        HUB_ID,
        "--target-placement",
        "offline",
        "--draft-vocab-size",
        "64",
        "--ttt-steps",
        "2",
        "--batch-size",
        "2",
        "--max-length",
        "32",
        "--max-steps",
        "2",
        "--eval-prompts",
        "0",
        "--threads",
        "1",
    ]
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "EYRIE_STEP_DIR": str(step),
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(argv, cwd=step, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "speculative decoding not measured (--eval-prompts 0)" in done.stdout  # not "nan"
    (first,) = (step / "features").iterdir()
    # Another snapshot of the same hub id (the repository moved on) gets features of its own.
    _hub_cache(cache, tiny / "target", "b" * 40)
    (step / "draft").rename(step / "draft-a")
    done = subprocess.run(argv, cwd=step, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    folders = sorted((step / "features").iterdir())
    assert len(folders) == 2 and first in folders
    assert all(is_complete(folder) for folder in folders)


def test_a_hub_id_target_is_fetched_for_the_files_the_steps_read(monkeypatch):
    asked = {}

    def snapshot_download(repo_id, allow_patterns=None, **kwargs):
        asked.update(repo_id=repo_id, patterns=allow_patterns)
        return "/nowhere"

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    target_module.model_folder(HUB_ID)
    assert asked["repo_id"] == HUB_ID

    def fetched(name: str) -> bool:
        return any(fnmatch.fnmatch(name, pattern) for pattern in asked["patterns"])

    wanted = [
        "config.json",
        "model.safetensors",
        "model-00001-of-00064.safetensors",
        "model.safetensors.index.json",
    ]
    assert all(map(fetched, wanted))
    # Kimi-K2.5 and others also ship other formats of the same weights: never fetched
    assert not any(map(fetched, ["pytorch_model.bin", "original/consolidated.00.pth", "model.gguf"]))


def test_sharded_with_several_processes_trains_in_one(tiny, tmp_path, capsys):
    """The pipeline file's defaults (EYRIE_TRAIN_PROCESSES=8) with EYRIE_TARGET_PLACEMENT=sharded:
    the launcher runs one process, before any worker could refuse."""
    cfg = TrainConfig(
        data=tiny / "shards", target=tiny / "target", out_dir=tmp_path, target_placement="sharded", nproc=8
    )
    launched = placement_for_launch(cfg)
    assert (launched.nproc, launched.target_placement) == (1, "sharded")
    assert "one process trains over every GPU, not --nproc 8" in capsys.readouterr().out


def test_a_rerun_that_cannot_resume_says_which_setting_changed(tiny, tmp_path):
    cfg = TrainConfig(
        data=tiny / "shards",
        target=tiny / "target",
        out_dir=tmp_path,
        draft_vocab_size=64,
        ttt_steps=2,
        batch_size=2,
        max_length=32,
        max_steps=2,
        checkpoint_every=1,
        lr=1e-3,
        threads=1,
        heldout_fraction=0.1,
    )
    first: list[str] = []
    train(cfg, log=first.append)
    assert not any("not resumed" in line for line in first)
    again: list[str] = []
    train(cfg.model_copy(update={"lr": 2e-3}), log=again.append)
    said = [line for line in again if "not resumed" in line]
    assert len(said) == 1 and "(step 2)" in said[0] and "lr 0.001 -> 0.002" in said[0], again
