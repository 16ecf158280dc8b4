"""A target stored quantized (compressed-tensors INT4, packed, as Kimi-K2.5's experts are) is held
packed as stored, computes what its INT4 weights give, and trains a draft: the ``quantized`` extra."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.steps.target import load_model
from pipeline.steps.target.quantized import PackedLinear
from pipeline.steps.train.loop import TrainConfig, train

pytest.importorskip("compressed_tensors", reason="the `quantized` extra is not installed")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

GROUP = 32


@pytest.fixture(scope="module")
def int4_target(tmp_path_factory):
    """A small Llama with every Linear but lm_head stored as packed INT4 (groups of 32), and the
    logits its quantized weights give (computed before saving)."""
    folder = tmp_path_factory.mktemp("int4") / "target"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=1,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    tokens = torch.randint(2, 128, (1, 16))
    with torch.no_grad():
        plain = model(tokens).logits
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP),
    )
    apply_quantization_config(
        model,
        QuantizationConfig(
            config_groups={"group_0": scheme},
            ignore=["lm_head"],
            format="pack-quantized",
            quantization_status="frozen",
        ),
    )
    for module in model.modules():
        if hasattr(module, "weight_scale"):  # symmetric scales from each group's largest weight
            largest = module.weight.detach().reshape(module.weight.shape[0], -1, GROUP).abs().amax(-1)
            scale, zero = calculate_qparams(-largest, largest, module.quantization_scheme.weights)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    with torch.no_grad():
        quantized = model(tokens).logits
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    return folder, tokens, plain, quantized


def test_packed_int4_weights_stay_packed_in_memory(int4_target):
    folder, tokens, plain, quantized = int4_target
    with safe_open(folder / "model.safetensors", "pt") as stored:
        assert stored.get_tensor("model.layers.0.mlp.down_proj.weight_packed").dtype == torch.int32
        assert "model.layers.0.mlp.down_proj.weight" not in stored.keys()
    target = load_model(folder, dtype=torch.float32, trust_remote_code=False)
    down = target.model.layers[0].mlp.down_proj
    assert isinstance(down, PackedLinear) and down.weight_packed.dtype == torch.int32
    assert not any(name.endswith("mlp.down_proj.weight") for name, _ in target.named_parameters())
    with torch.no_grad():
        logits = target(tokens).logits
    assert torch.allclose(logits, quantized, atol=1e-5)
    assert not torch.allclose(logits, plain, atol=1e-3)  # the INT4 weights, not the originals


def test_dequantized_on_purpose_it_computes_the_same(int4_target):
    folder, tokens, _, quantized = int4_target
    target = load_model(folder, dtype=torch.float32, trust_remote_code=False, dequantize=True)
    assert not any(isinstance(m, PackedLinear) for m in target.modules())
    with torch.no_grad():
        assert torch.allclose(target(tokens).logits, quantized, atol=1e-5)


def test_a_draft_trains_against_the_quantized_target(int4_target, tmp_path):
    folder = int4_target[0]
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randint(2, 128, (24,), generator=generator).tolist() for _ in range(16)]
    (tmp_path / "shards").mkdir()
    pq.write_table(
        pa.table({"input_ids": rows, "loss_mask": [[0] * 8 + [1] * 16] * 16}),
        tmp_path / "shards" / "shard-00000.parquet",
    )
    cfg = TrainConfig(
        data=tmp_path / "shards",
        target=folder,
        out_dir=tmp_path / "train",
        draft_vocab_size=64,
        ttt_steps=2,
        layer_ids=[1, 2, 3],
        batch_size=2,
        max_steps=3,
        heldout_fraction=0.0,
        checkpoint_every=100,
        threads=1,
    )
    result = train(cfg, log=lambda _: None)
    assert result["summary"]["optimizer_steps"] == 3 and result["summary"]["final"]["loss"] > 0
