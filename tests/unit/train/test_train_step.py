"""The training step as the pipeline runs it: a subprocess, killed with -9 and rerun, and under torchrun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.contract.step import check_manifest
from pipeline.steps.train import checkpoint as ckpt

EYRIE = [sys.executable, "-m", "pipeline.cli"]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> dict[str, Path]:
    """A small random target and random tokenized shards: enough to exercise the loop quickly."""
    root = tmp_path_factory.mktemp("train-step")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=1,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(root / "target")
    generator = torch.Generator().manual_seed(1)
    rows = {"input_ids": [], "loss_mask": [], "source": []}
    for i in range(64):
        n = 24 + i % 16
        ids = torch.randint(2, 128, (n,), generator=generator).tolist()
        rows["input_ids"].append(ids)
        rows["loss_mask"].append([0] * 8 + [1] * (n - 8))
        rows["source"].append("random")
    (root / "shards").mkdir()
    pq.write_table(pa.table(rows), root / "shards" / "shard-00000.parquet")
    return {"root": root, "target": root / "target", "data": root / "shards"}


def _train_argv(run: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [
        *EYRIE,
        "train",
        "--data",
        str(run["data"]),
        "--target",
        str(run["target"]),
        "--draft-vocab-size",
        "64",
        "--ttt-steps",
        "3",
        "--batch-size",
        "2",
        "--max-steps",
        "16",
        "--checkpoint-every",
        "2",
        "--eval-prompts",
        "2",
        "--eval-max-new-tokens",
        "8",
        "--lr",
        "1e-3",
        "--threads",
        "1",
        "--heldout-fraction",
        "0.1",
        *extra,
    ]


def _checkpoints(step_dir: Path) -> list[Path]:
    """Complete checkpoints of every run key under the step dir, oldest first."""
    runs = (step_dir / "checkpoints").glob("*")
    return sorted((c for run in runs for c in ckpt.complete(run)), key=lambda p: p.name)


def _env(step_dir: Path) -> dict[str, str]:
    return {**os.environ, "EYRIE_STEP_DIR": str(step_dir), "OMP_NUM_THREADS": "1"}


def _run(argv, step_dir: Path) -> subprocess.CompletedProcess:
    step_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.run(argv, cwd=step_dir, env=_env(step_dir), capture_output=True, text=True, timeout=400)


def test_resume_after_kill_9_ends_with_the_same_steps_and_weights(small_run):
    straight = small_run["root"] / "straight"
    done = _run(_train_argv(small_run, straight), straight)
    assert done.returncode == 0, done.stderr[-2000:]
    ok, why = check_manifest(straight, ["draft", "eval.json"])
    assert ok, why
    stats = json.loads((straight / "manifest.json").read_text())["stats"]
    assert stats["precision"] == "fp32"  # auto on a CPU
    assert stats["attention"] == "sdpa"  # the target's forward: flash-attn's kernels need a GPU

    killed = small_run["root"] / "killed"
    killed.mkdir()
    proc = subprocess.Popen(
        _train_argv(small_run, killed),
        cwd=killed,
        env=_env(killed),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    # Kill once a checkpoint beyond the first exists: mid-run, possibly mid-write of the next one.
    while time.monotonic() < deadline and proc.poll() is None:
        found = _checkpoints(killed)
        if found and found[-1].name >= "step-00000006":
            break
        time.sleep(0.05)
    assert proc.poll() is None, "training finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "eval.json").exists() and not (killed / "manifest.json").exists()
    killed_at = json.loads((_checkpoints(killed)[-1] / "meta.json").read_text())["step"]
    assert 6 <= killed_at < 16

    rerun = _run(_train_argv(small_run, killed), killed)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"resumed from step {killed_at} of 16" in rerun.stdout
    a = json.loads((straight / "eval.json").read_text())
    b = json.loads((killed / "eval.json").read_text())
    assert a["optimizer_steps"] == b["optimizer_steps"] == 16
    assert b["resumed_from_step"] == killed_at
    wa, wb = (
        load_file(straight / "draft" / "model.safetensors"),
        load_file(killed / "draft" / "model.safetensors"),
    )
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-5, atol=1e-6, msg=key)
    ok, why = check_manifest(killed, ["draft", "eval.json"])
    assert ok, why


def test_torchrun_two_processes_gloo(small_run):
    step = small_run["root"] / "ddp"
    done = _run(_train_argv(small_run, step, "--nproc", "2", "--max-steps", "4"), step)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((step / "eval.json").read_text())
    assert report["world_size"] == 2 and report["optimizer_steps"] == 4
    ok, why = check_manifest(step, ["draft", "eval.json"])
    assert ok, why


def test_a_token_budget_trains(small_run):
    """--batch-tokens 64 over rows of 24-39 tokens: a step takes the rows that fit 64 tokens padded
    (one or two), and the settings the checkpoints are keyed by say so."""
    step = small_run["root"] / "by-tokens"
    argv = _train_argv(small_run, step, "--max-steps", "4")
    at = argv.index("--batch-size")
    argv[at : at + 2] = ["--batch-tokens", "64"]
    done = _run(argv, step)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((step / "eval.json").read_text())
    assert report["optimizer_steps"] == 4
    settings = json.loads(next((step / "checkpoints").glob("*/settings.json")).read_text())
    assert settings["config"]["batch_tokens"] == 64 and settings["config"]["batch_size"] == 1


def test_missing_input_is_a_one_line_error(small_run, tmp_path):
    done = _run(
        [*EYRIE, "train", "--data", str(tmp_path / "nope"), "--target", str(small_run["target"])], tmp_path
    )
    assert done.returncode == 2
    assert "--data" in done.stderr and "does not exist" in done.stderr
    assert not (tmp_path / "manifest.json").exists()


def test_bad_settings_are_one_line_errors_also_under_torchrun(small_run, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("lrr: 1\n")
    done = _run(_train_argv(small_run, tmp_path / "step", "--config", str(config)), tmp_path / "step")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith(f"error: {config}: lrr: unknown setting")
    assert len(done.stderr.splitlines()) == 1

    # A target whose weights are missing is found by the workers: one line, no traceback, no resume.
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    (weightless / "config.json").write_text((small_run["target"] / "config.json").read_text())
    argv = [*EYRIE, "train", "--data", str(small_run["data"]), "--target", str(weightless), "--nproc", "2"]
    done = _run(argv, tmp_path / "ddp")
    assert done.returncode == 2, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(said) == 1 and "cannot load the model" in said[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "rerun" not in done.stderr
    assert not (tmp_path / "ddp" / "manifest.json").exists()


def test_shards_of_another_vocabulary_are_a_one_line_error(small_run, tmp_path):
    (tmp_path / "shards").mkdir()
    rows = {"input_ids": [[5, 6, 500, 7] * 4] * 4, "loss_mask": [[0, 1, 1, 1] * 4] * 4}
    pq.write_table(pa.table(rows), tmp_path / "shards" / "shard-00000.parquet")
    step = tmp_path / "step"
    done = _run(
        [*EYRIE, "train", "--data", str(tmp_path / "shards"), "--target", str(small_run["target"])], step
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "token id 500" in done.stderr and "Traceback" not in done.stderr
    assert not (step / "manifest.json").exists()


def test_checkpoints_are_keyed_by_settings_and_data(small_run, tmp_path):
    from pipeline.steps.train.loop import TrainConfig, run_key

    cfg = TrainConfig(data=small_run["data"], target=small_run["target"], out_dir=tmp_path)
    same = cfg.model_copy(update={"threads": 1, "eval_prompts": 3, "out_dir": tmp_path / "x"})
    assert run_key(cfg, 1) == run_key(same, 1)
    assert run_key(cfg, 1) != run_key(cfg.model_copy(update={"lr": 5e-4}), 1)
    assert run_key(cfg, 1) != run_key(cfg, 2)
