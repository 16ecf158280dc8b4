"""The three placements train the same draft: same losses, same weights, on a dense and on a
mixture-of-experts target (DeepSeek-V3 style: MLA attention, a dense first layer, shared and routed
experts).

On the CPU, "sharded" runs the planner over two devices given as figures (both the CPU), loads the
target through ``from_pretrained`` with the planned per-module device map and trains through the same
feature path (hidden states gathered from each layer's device onto the draft's). What that proves:
the plan covers every module, loading by plan gives the same model, and the feature and teacher path
computes the same numbers. What it does not: transfers between GPUs (with one device kind transformers
installs no dispatch hooks) and the planned bytes per GPU, which only a GPU run can measure.

"Offline" runs the real features pass (shards on disk, then training from them with the target's
lm_head only). Its features come from batches padded differently from the training batches, so its
numbers may differ in the last float32 bits.

Tolerance, for both against replicated after 8 steps: weights ``rtol=1e-4, atol=1e-6``, the final loss
``rel=1e-5``, the per-step accuracies ``abs=1e-6``. Measured here: sharded is bit-identical; offline's
weights are at most 1.2e-7 apart and its final loss is equal.
"""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

from pipeline.steps.train import loop as train_module
from pipeline.steps.train.features import LOGITS_CHUNK
from pipeline.steps.train.launch import placement_for_launch
from pipeline.steps.train.loop import TrainConfig, prepare, train
from pipeline.steps.train.placement import HEADROOM, Device, target_units

VOCAB = 128
TARGETS = {
    "dense": (
        LlamaForCausalLM,
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            eos_token_id=1,
            pad_token_id=0,
        ),
    ),
    "moe": (
        DeepseekV3ForCausalLM,
        DeepseekV3Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=8,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            max_position_embeddings=256,
            eos_token_id=1,
            pad_token_id=0,
        ),
    ),
}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("placement-data")
    generator = torch.Generator().manual_seed(3)
    rows = {"input_ids": [], "loss_mask": []}
    for i in range(40):
        n = 20 + i % 13
        rows["input_ids"].append(torch.randint(2, VOCAB, (n,), generator=generator).tolist())
        rows["loss_mask"].append([0] * 6 + [1] * (n - 6))
    pq.write_table(pa.table(rows), root / "shard-00000.parquet")
    return root


def _target(tmp_path, kind: str):
    model_class, config = TARGETS[kind]
    torch.manual_seed(0)
    model_class(config).save_pretrained(tmp_path / kind)
    return tmp_path / kind


def _settings(data, target, out, placement: str) -> TrainConfig:
    return TrainConfig(
        data=data,
        target=target,
        out_dir=out,
        target_placement=placement,
        draft_vocab_size=64,
        ttt_steps=3,
        batch_size=2,
        max_length=48,
        max_steps=8,
        checkpoint_every=4,
        log_every=4,
        lr=1e-3,
        threads=1,
        heldout_fraction=0.1,
    )


def _two_devices(cfg: TrainConfig) -> list[Device]:
    """Two devices (both the CPU) with just the free memory for the draft, the embedding and layers 0-3
    on the first and layers 4-7, the norm and the lm_head on the second."""
    setup = prepare(cfg, 1, [Device("cpu", 1 << 40)])
    vocab = setup.draft.config.draft_vocab_size
    units = target_units(setup.config, setup.dtype, cfg.batch_size, setup.longest, vocab, LOGITS_CHUNK)
    first = setup.plan.shares[0].draft + sum(u.weights + u.activations for u in units[:5])
    second = sum(u.weights + u.activations for u in units[5:])
    return [Device("cpu", math.ceil(need / (1 - HEADROOM)) + 1) for need in (first, second)]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_replicated_sharded_and_offline_train_the_same_draft(tmp_path, shards, kind):
    target = _target(tmp_path, kind)
    results = {}
    for placement in ("replicated", "sharded", "offline"):
        cfg = _settings(shards, target, tmp_path / placement, placement)
        devices = _two_devices(cfg) if placement == "sharded" else None
        lines: list[str] = []
        results[placement] = train(cfg, log=lines.append, devices=devices)
        assert lines[0].startswith(f"target placement: {placement} ")
    sharded = results["sharded"]["built"].setup.plan
    assert [share.layers for share in sharded.shares] == [[0, 1, 2, 3], [4, 5, 6, 7]], sharded.describe()
    assert sharded.shares[0].draft and not sharded.shares[1].draft
    assert results["offline"]["target"] is None  # training never held the target

    reference = results["replicated"]
    weights = reference["draft"].state_dict()
    for placement in ("sharded", "offline"):
        result = results[placement]
        assert result["summary"]["optimizer_steps"] == 8
        final, expected = result["summary"]["final"], reference["summary"]["final"]
        assert final["loss"] == pytest.approx(expected["loss"], rel=1e-5), placement
        assert final["acc"] == pytest.approx(expected["acc"], abs=1e-6), placement
        other = result["draft"].state_dict()
        assert other.keys() == weights.keys()
        for name, tensor in weights.items():
            torch.testing.assert_close(other[name], tensor, rtol=1e-4, atol=1e-6, msg=f"{placement}: {name}")


def test_auto_with_several_processes_trains_sharded_in_one_when_no_device_holds_the_target(
    tmp_path, shards, monkeypatch
):
    cfg = _settings(shards, _target(tmp_path, "dense"), tmp_path / "out", "auto")
    cfg = cfg.model_copy(update={"nproc": 2})
    devices = _two_devices(cfg)

    def in_the_launcher(*args, **kwargs):
        raise AssertionError(
            "the launcher, which outlives the workers, must not hold the rows or CUDA contexts"
        )

    # The plan is made in a child process of its own: what it loads goes with it.
    monkeypatch.setattr(train_module, "prepare", in_the_launcher)
    monkeypatch.setattr(train_module, "load_shards", in_the_launcher)
    launched = placement_for_launch(cfg, devices)
    assert (launched.nproc, launched.target_placement) == (1, "sharded")
    # one device that holds it: every rank holds a copy, as asked
    assert placement_for_launch(cfg, [Device("cpu", 1 << 40)]) == cfg
