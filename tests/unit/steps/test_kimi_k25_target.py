"""Kimi-K2.5 as it ships, on the CPU: the tests' tiny Kimi-K2.5 (tests/fixtures/kimi_k25: the
vision-language wrapper and its remote code, a DeepSeek-V3 text model, routed experts INT4
``pack-quantized`` with Moonshot's ignore list) is trained against its language model, with its
experts held packed, in both layouts (the remote code's Linear per expert, transformers' fused
experts), and its features equal those of the same model dequantized up front."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open

from pipeline.steps.eagle3.export import load_draft
from pipeline.steps.target import load_model, target_config
from pipeline.steps.target.quantized import PACKED_EXPERTS, PackedLinear
from pipeline.steps.train.cli import check_inputs
from pipeline.steps.train.features import OnlineTarget
from pipeline.steps.train.launch import worker
from pipeline.steps.train.loop import TrainConfig
from pipeline.steps.train.placement import target_units

pytest.importorskip("compressed_tensors", reason="the `quantized` extra is not installed")
from tests.fixtures.kimi_k25 import build_tiny_kimi  # noqa: E402

# What the packed forward may differ by from the dequantized one: the same dequantized weights, in
# another order of float32 additions (one expert at a time against transformers' grouped experts).
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return build_tiny_kimi(tmp_path_factory.mktemp("kimi") / "Kimi-K2.5")


@pytest.fixture(scope="module")
def shards(kimi, tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards") / "shards"
    folder.mkdir()
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 4096, (24,), generator=generator).tolist() for _ in range(12)]
    table = pa.table({"input_ids": rows, "loss_mask": [[0] * 8 + [1] * 16] * len(rows)})
    pq.write_table(table, folder / "shard-00000.parquet")
    return folder


def test_the_fixture_ships_as_kimi_k25_does(kimi):
    config = json.loads((kimi / "config.json").read_text())
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"] and "auto_map" in config
    assert config["text_config"]["model_type"] == "kimi_k2"
    quantization = config["text_config"]["quantization_config"]
    assert quantization["format"] == "pack-quantized" and "lm_head" in quantization["ignore"]
    with safe_open(kimi / "model.safetensors", "pt") as stored:
        names = set(stored.keys())
        packed = stored.get_tensor("language_model.model.layers.1.mlp.experts.0.down_proj.weight_packed")
    assert packed.dtype == torch.int32
    for dense in (
        "language_model.model.layers.0.mlp.down_proj.weight",  # the dense first layer
        "language_model.model.layers.1.mlp.shared_experts.down_proj.weight",
        "language_model.model.layers.1.self_attn.kv_b_proj.weight",
        "language_model.lm_head.weight",
        "vision_tower.patch_embed.weight",
        "mm_projector.weight",
    ):
        assert dense in names
    assert "language_model.model.layers.1.mlp.experts.0.down_proj.weight" not in names


@pytest.mark.parametrize("remote_code", [True, False], ids=["remote-code", "transformers-class"])
def test_packed_features_equal_the_dequantized_ones(kimi, remote_code):
    packed = load_model(kimi, dtype=torch.float32, trust_remote_code=remote_code)
    dense = load_model(kimi, dtype=torch.float32, trust_remote_code=remote_code, dequantize=True)
    if remote_code:  # Kimi's own code: a Linear per expert, each replaced by a packed one
        assert isinstance(packed.model.layers[1].mlp.experts[0].down_proj, PackedLinear)
    else:  # transformers' DeepSeek-V3: fused experts through the packed experts implementation
        assert type(packed).__module__.startswith("transformers.models.deepseek_v3")
        assert packed.config._experts_implementation == PACKED_EXPERTS
    held = {n: t.dtype for n, t in packed.named_buffers() if "experts" in n and "packed" in n}
    assert held and set(held.values()) == {torch.int32}
    assert not any("experts" in n and "shared" not in n for n, _ in packed.named_parameters())

    def experts_bytes(model) -> int:
        tensors = [*model.named_parameters(), *model.named_buffers()]
        return sum(t.numel() * t.element_size() for n, t in tensors if "experts" in n and "shared" not in n)

    # 4 bits a weight and an fp32 scale per 32 against fp32 weights: 0.16 of the dense bytes.
    assert experts_bytes(packed) < 0.2 * experts_bytes(dense)
    ids = torch.randint(0, 4096, (2, 20), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    layers = [0, 1, 2]
    vocab = torch.zeros(packed.config.vocab_size, dtype=torch.bool)
    got = OnlineTarget(packed, layers, torch.zeros(2, dtype=torch.long), vocab).hidden(ids, mask, "cpu")
    want = OnlineTarget(dense, layers, torch.zeros(2, dtype=torch.long), vocab).hidden(ids, mask, "cpu")
    for a, b in zip(got, want, strict=True):  # the aux features (3 layers), then the last hidden state
        assert torch.allclose(a, b, atol=TOLERANCE, rtol=0), (a - b).abs().max()


def test_both_layouts_compute_the_same_target(kimi):
    ids = torch.randint(0, 4096, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        remote = load_model(kimi, dtype=torch.float32, trust_remote_code=True)(ids).logits
        native = load_model(kimi, dtype=torch.float32, trust_remote_code=False)(ids).logits
    assert torch.allclose(remote, native, atol=TOLERANCE, rtol=0)


def test_the_plan_takes_the_language_model_and_states_the_vision_tower(kimi):
    config = target_config(kimi, trust_remote_code=True)
    units = target_units(config, torch.float32, 1, 32, 64, 32, trust_remote_code=True)
    with safe_open(kimi / "model.safetensors", "pt") as stored:
        tensors = [stored.get_tensor(n) for n in stored.keys() if not n.startswith("language_model.")]
    vision = sum(t.numel() * t.element_size() for t in tensors)
    assert units.left_out == vision and units.holding == "packed"
    assert [u.module for u in units][:2] == ["model.embed_tokens", "model.layers.0"]
    assert sum(u.packed for u in units) > 0


def test_the_wrapper_is_checked_on_its_language_model(kimi, shards):
    # Before: AttributeError: 'KimiK25Config' object has no attribute 'hidden_act', a traceback.
    check_inputs(TrainConfig(data=shards, target=kimi, trust_remote_code=True))


@pytest.mark.parametrize("placement", ["sharded", "offline"])
def test_a_draft_trains_against_the_packed_wrapper_and_loads_strictly(kimi, shards, tmp_path, placement):
    cfg = TrainConfig(
        data=shards,
        target=kimi,
        out_dir=tmp_path / "train",
        trust_remote_code=True,
        draft_vocab_size=64,
        ttt_steps=2,
        layer_ids=[0, 1, 2],
        batch_size=2,
        max_steps=2,
        heldout_fraction=0.2,
        checkpoint_every=100,
        threads=1,
        target_placement=placement,
        eval_prompts=1,
        eval_max_new_tokens=3,
    )
    assert worker(cfg) == 0  # trains, exports the draft, decodes a held-out prompt with the packed target
    report = json.loads((tmp_path / "train" / "eval.json").read_text())
    assert report["optimizer_steps"] == 2 and report["speculative_decoding"]["acceptance_length"]
    plan = report["target_placement"]
    assert plan["placement"] == placement and plan["target_holding"] == "packed"
    assert plan["left_out_bytes"] > 0  # the vision tower, never loaded
    shares = plan["features_pass"]["devices"] if placement == "offline" else plan["devices"]
    assert shares[0]["packed_bytes"] > 0 and shares[0]["transient_bytes"] > 0
    with safe_open(kimi / "model.safetensors", "pt") as stored:
        embedding = stored.get_tensor("language_model.model.embed_tokens.weight")
    draft = load_draft(tmp_path / "train" / "draft", embedding)
    assert draft.config.target_hidden_size == 64
