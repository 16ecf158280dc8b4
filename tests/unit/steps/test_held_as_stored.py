"""Quantized targets are planned as they are held (pipeline/steps/target/): packed INT weights
at their stored bytes with the largest expert's dequantized transient per device, FP8 as stored on a
GPU, any other format refused before anything loads, with its dense size."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DeepseekV3Config, LlamaConfig

from pipeline.steps.target.format import target_format
from pipeline.steps.target.holding import HeldFormatError
from pipeline.steps.train.placement import Device, plan, target_units

pytest.importorskip("compressed_tensors", reason="the `quantized` extra is not installed")

GiB = 1024**3
GROUP = 32
# Routed experts INT4 in groups of 32, everything else as Moonshot leaves it (Kimi-K2.5's scheme).
INT4_EXPERTS = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": GROUP,
            },
        }
    },
    "ignore": ["lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj$"],
}
MOE = DeepseekV3Config(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    n_routed_experts=32,
    num_experts_per_tok=4,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    tie_word_embeddings=False,
)
LLAMA = LlamaConfig(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)


def quantized(config, quantization: dict):
    config = copy.deepcopy(config)
    config.quantization_config = quantization
    return config


def units(config, device_type: str = "cpu", dequantize: bool = False):
    return target_units(
        config, torch.bfloat16, 1, 64, 256, 64, device_type=device_type, dequantize=dequantize
    )


def expert_parameters(config) -> int:
    layers = config.num_hidden_layers - config.first_k_dense_replace
    return layers * config.n_routed_experts * 3 * config.moe_intermediate_size * config.hidden_size


def test_packed_int4_experts_are_planned_at_their_stored_bytes():
    dense, packed = units(MOE), units(quantized(MOE, INT4_EXPERTS))
    experts = expert_parameters(MOE)
    # 4 bits a weight and a bf16 scale per group of 32, against 2 bytes a weight dense (weight_shape
    # adds 16 bytes per expert projection).
    stored = experts // 2 + experts // GROUP * 2
    saved = sum(u.weights for u in dense) - sum(u.weights for u in packed)
    assert saved == pytest.approx(experts * 2 - stored, rel=0.01)
    assert sum(u.packed for u in packed) == pytest.approx(stored, rel=0.01)
    assert packed.holding == "packed" and dense.holding == "dense"
    # What one expert makes while its forward runs: gate, up and down dense at bf16.
    one_expert = 3 * MOE.moe_intermediate_size * MOE.hidden_size * 2
    assert [u.transient for u in packed if u.module.startswith("model.layers.")] == [0] + [one_expert] * 3


def test_each_device_records_packed_dense_and_the_largest_expert():
    target = units(quantized(MOE, INT4_EXPERTS))
    total = sum(u.weights + u.activations for u in target)
    result = plan("sharded", target, [Device(f"cuda:{i}", int(total * 0.8)) for i in range(2)], 0, 1)
    devices = result.as_dict()["devices"]
    assert len(devices) == 2 and result.as_dict()["target_holding"] == "packed"
    for device in devices:
        assert device["packed_bytes"] + device["dense_bytes"] == device["weight_bytes"]
        assert device["packed_bytes"] > 0
        assert device["transient_bytes"] == 3 * MOE.moe_intermediate_size * MOE.hidden_size * 2
        assert device["planned_bytes"] >= device["weight_bytes"] + device["transient_bytes"]
    assert "packed" in "\n".join(result.describe())


def test_forced_to_dequantize_a_packed_target_is_planned_dense():
    target = quantized(MOE, INT4_EXPERTS)
    assert sum(u.weights for u in units(target, dequantize=True)) == sum(u.weights for u in units(MOE))


def test_fp8_is_planned_as_stored_on_a_gpu_and_refused_on_the_cpu():
    fp8 = quantized(LLAMA, {"quant_method": "fp8", "weight_block_size": [128, 128]})
    # The decoder layers' Linear weights; transformers keeps the lm_head out of FP8.
    hidden, inner = LLAMA.hidden_size, LLAMA.intermediate_size
    linear = LLAMA.num_hidden_layers * (4 * hidden**2 + 3 * hidden * inner)
    gpu = units(fp8, device_type="cuda")
    assert sum(u.weights for u in units(LLAMA)) - sum(u.weights for u in gpu) == linear  # 1 byte, not 2
    assert gpu.holding == "stored"
    with pytest.raises(HeldFormatError, match=r"'fp8'.*only on a GPU; dequantized it would need"):
        units(fp8)


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes"])
def test_other_formats_are_refused_with_their_dense_size(method):
    refusal = target_format(quantized(LLAMA, {"quant_method": method, "bits": 4}), device_type="cuda").refused
    refused = refusal.error(5 * GiB)
    assert isinstance(refused, HeldFormatError)
    assert f"'{method}'" in str(refused) and "5.00 GiB" in str(refused)


def test_a_wrapper_stored_in_fp8_is_refused_before_its_weights_are_read_without_scales():
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config

    text = quantized(MOE, {"quant_method": "fp8", "weight_block_size": [128, 128]}).to_dict()
    wrapper = Kimi_K25Config(text_config=text)
    with pytest.raises(HeldFormatError, match="vision-language wrapper .* 'fp8'"):
        units(wrapper, device_type="cuda")
