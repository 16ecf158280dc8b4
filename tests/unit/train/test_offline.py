"""The offline placement's features pass: resumable shard by shard, its disk need checked before it
starts, and usable as one pipeline step (``eyrie train --target-placement offline``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import namedtuple

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.contract.step import check_manifest, read_manifest
from pipeline.steps.shards import Example
from pipeline.steps.train import loop as train_module
from pipeline.steps.train import offline
from pipeline.steps.train.features import OnlineTarget
from pipeline.steps.train.loop import TrainConfig, features_pass, prepare
from pipeline.steps.train.offline import (
    FeaturesError,
    FeatureShards,
    is_complete,
    pending_pass,
    row_digest,
    write_features,
)
from pipeline.steps.train.placement import HEADROOM, Device, PlacementError

HIDDEN = 32
LAYERS = [1, 3, 4]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("offline") / "target"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=1,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def source(target_dir):
    model = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    vocab = torch.arange(64)
    return OnlineTarget(model, LAYERS, torch.zeros(64, dtype=torch.long), vocab < 64, torch.device("cpu"))


def _rows(count: int) -> list[Example]:
    generator = torch.Generator().manual_seed(5)
    rows = []
    for i in range(count):
        n = 18 + i % 11
        rows.append(Example(torch.randint(2, 128, (n,), generator=generator).tolist(), [1] * n, ""))
    return rows


def _write(hidden, rows, folder, log=lambda _: None):
    write_features(hidden, pending_pass(rows, folder, HIDDEN, torch.float32), LAYERS, 2, 0, log)


def test_a_pass_stopped_midway_resumes_with_the_shards_it_wrote(source, tmp_path, monkeypatch):
    """Each shard is renamed into place whole, so a pass stopped by an error or a kill leaves whole
    shards and no index; the rerun writes the rest and reads back what a forward of each row gives."""
    monkeypatch.setattr(offline, "SHARD_BYTES", 3 * 25 * offline.bytes_per_token(HIDDEN, torch.float32))
    rows = _rows(30)
    folder = tmp_path / "features"
    calls = []

    def failing(input_ids, attention_mask, device):
        calls.append(1)
        if len(calls) > 6:
            raise RuntimeError("stopped")
        return source.hidden(input_ids, attention_mask, device)

    with pytest.raises(RuntimeError, match="stopped"):
        _write(failing, rows, folder)
    written = sorted(p.name for p in folder.iterdir())
    assert written == [f"shard-{i:05d}.safetensors" for i in range(3)]  # two forwards a shard
    assert not is_complete(folder)
    before = {name: (folder / name).stat().st_mtime_ns for name in written}
    # What a kill -9 during a write leaves besides: the temporary file of the shard in progress.
    (folder / ".shard-00003.safetensors.tmp-4242").write_bytes(b"torn")

    said: list[str] = []
    _write(source.hidden, rows, folder, said.append)
    assert is_complete(folder)
    assert said[0].endswith(f"shards under {folder} (3 already written)")
    assert {name: (folder / name).stat().st_mtime_ns for name in written} == before
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]
    index = json.loads((folder / "index.json").read_text())
    assert index["rows"] == 30 and index["bytes_per_token"] == 4 * HIDDEN * 4
    assert index["tokens"] == sum(len(r.input_ids) for r in rows)

    shards = FeatureShards(folder)
    for row in rows[::7]:
        ids = torch.tensor([row.input_ids])
        features, last = source.hidden(ids, torch.ones_like(ids), torch.device("cpu"))
        got_features, got_last = shards.row(row_digest(row.input_ids))
        torch.testing.assert_close(got_features, features[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_last, last[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=f"a row has no features in {folder}: its pass saw other rows"):
        shards.row(row_digest([5, 6, 7]))


def test_the_disk_need_is_checked_before_the_target_runs(source, tmp_path, monkeypatch):
    rows = _rows(10)
    tokens = sum(len(r.input_ids) for r in rows)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(offline.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 4096, 4096))

    def never(*args):
        raise AssertionError("the target ran before the disk was checked")

    with pytest.raises(ValueError) as refused:
        _write(never, rows, tmp_path / "features")
    needed = tokens * 4 * HIDDEN * 4
    assert str(refused.value) == (
        f"offline features need {needed / 1024:.2f} KiB more in {tmp_path / 'features'} "
        f"({tokens:,} tokens x 4 x {HIDDEN} x 4 bytes), which has 4.00 KiB free: free space, "
        "give --features-dir a larger disk, or use --target-placement sharded"
    )
    assert list((tmp_path / "features").iterdir()) == []


def test_offline_is_one_pipeline_step(target_dir, tmp_path):
    generator = torch.Generator().manual_seed(2)
    rows = {"input_ids": [], "loss_mask": []}
    for i in range(40):
        n = 20 + i % 13
        rows["input_ids"].append(torch.randint(2, 128, (n,), generator=generator).tolist())
        rows["loss_mask"].append([0] * 6 + [1] * (n - 6))
    (tmp_path / "shards").mkdir()
    pq.write_table(pa.table(rows), tmp_path / "shards" / "shard-00000.parquet")
    step = tmp_path / "step"
    step.mkdir()
    argv = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "train",
        "--data",
        str(tmp_path / "shards"),
        "--target",
        str(target_dir),
        "--target-placement",
        "offline",
        "--draft-vocab-size",
        "64",
        "--ttt-steps",
        "3",
        "--batch-size",
        "2",
        "--max-length",
        "48",
        "--max-steps",
        "6",
        "--eval-prompts",
        "2",
        "--eval-max-new-tokens",
        "6",
        "--threads",
        "1",
    ]
    env = {**os.environ, "EYRIE_STEP_DIR": str(step), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, cwd=step, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.splitlines()
    assert out[0].startswith("target placement: offline (the target writes its features once, the target (")
    assert out[1].startswith("  device 0 (cpu): lm_head, the draft; planned ")
    assert out[2].startswith(
        "features pass: device 0 (cpu): layers 0-7, embed_tokens, norm, rotary_emb, lm_head"
    )
    assert any(line.startswith("features pass: shard 1/1 written") for line in out)
    ok, why = check_manifest(step, ["draft", "eval.json"])
    assert ok, why
    recorded = read_manifest(step).stats["target_placement"]
    assert recorded["placement"] == "offline" and recorded["devices"][0]["modules"] == ["lm_head"]
    assert recorded["features_pass"]["devices"][0]["layers"] == list(range(8))
    report = json.loads((step / "eval.json").read_text())
    assert report["speculative_decoding"]["verify_forwards"] > 0  # decoding loaded the target after training
    (features,) = (step / "features").iterdir()
    assert is_complete(features)

    # A second run resumes: the pass is complete and training is done, nothing is recomputed.
    shutil.rmtree(step / "draft")
    again = subprocess.run(argv, cwd=step, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"features pass: complete in {features}" in again.stdout
    assert "resumed from step 6 of 6" in again.stdout

    # Under DDP the launching process runs (here: finds) the pass; every worker trains from its shards.
    ddp = tmp_path / "ddp"
    ddp.mkdir()
    argv += [
        "--nproc",
        "2",
        "--max-steps",
        "2",
        "--eval-prompts",
        "0",
        "--features-dir",
        str(step / "features"),
    ]
    env = {**env, "EYRIE_STEP_DIR": str(ddp)}
    two = subprocess.run(argv, cwd=ddp, env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert f"features pass: complete in {features}" in two.stdout
    report = json.loads((ddp / "eval.json").read_text())
    assert report["world_size"] == 2 and report["target_placement"]["placement"] == "offline"


@pytest.fixture
def wide_run(tmp_path):
    """Settings of an offline training whose target (16 layers) outweighs what training holds beside it
    (the draft and the lm_head), and a device with room for the latter only."""
    target = tmp_path / "wide-target"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=1024,
        num_hidden_layers=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=1,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(target)
    generator = torch.Generator().manual_seed(2)
    rows = {"input_ids": [], "loss_mask": []}
    for i in range(12):
        n = 20 + i % 5
        rows["input_ids"].append(torch.randint(2, 128, (n,), generator=generator).tolist())
        rows["loss_mask"].append([0] * 6 + [1] * (n - 6))
    (tmp_path / "shards").mkdir()
    pq.write_table(pa.table(rows), tmp_path / "shards" / "shard-00000.parquet")
    cfg = TrainConfig(
        data=tmp_path / "shards",
        target=target,
        out_dir=tmp_path / "out",
        target_placement="offline",
        draft_vocab_size=64,
        ttt_steps=2,
        batch_size=2,
        max_length=32,
        threads=1,
        heldout_fraction=0.1,
    )
    whole = prepare(cfg, 1, [Device("cpu", 1 << 40)])
    training = whole.plan.shares[0].planned
    target_alone = sum(share.planned for share in whole.plan.features.shares)
    assert target_alone > 1.2 * training, (target_alone, training)
    return cfg, whole, Device("cpu", int(training / (1 - HEADROOM)) + 1024)


def test_workers_plan_what_they_hold_once_the_launcher_wrote_the_features(wide_run):
    """--nproc > 1: each worker measures only its own device, which cannot hold the target; the
    pass ran before, in the launching process, over every device: the workers must not plan it again."""
    cfg, whole, own_device = wide_run
    with pytest.raises(PlacementError):  # the device cannot hold the target: the pass needs them all
        prepare(cfg, 1, [own_device])
    features_pass(cfg, whole, lambda _: None)
    worker = prepare(cfg, 2, [own_device])
    assert worker.plan.placement == "offline" and worker.plan.features is None
    assert worker.plan.reason == "the target's features are on disk; training holds its lm_head"
    assert worker.plan.shares[0].modules == ["lm_head"]


def test_the_features_pass_checks_the_disk_before_it_loads_the_target(wide_run, monkeypatch):
    cfg, whole, _ = wide_run
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(offline.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 4096, 4096))

    def load(*args):
        raise AssertionError("the target was loaded before the disk was checked")

    monkeypatch.setattr(train_module, "_load", load)
    with pytest.raises(FeaturesError, match=r"^offline features need .* which has 4\.00 KiB free"):
        features_pass(cfg, whole, lambda _: None)
