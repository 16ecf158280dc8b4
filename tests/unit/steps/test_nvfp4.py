"""GLM-5 stored as ModelOpt's NVFP4 (tests/fixtures/glm5_nvfp4/, no weights), planned as it is held
(pipeline/steps/target/): on a Blackwell GPU its experts at their stored bytes (e2m1 weights,
an fp8 scale per 16, an fp32 global scale), anywhere else refused up front with its dense size."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoConfig, GlmMoeDsaConfig

from eyrie_testing import REPO
from pipeline.memory.units import format_size
from pipeline.steps.target import TargetError, load_model
from pipeline.steps.target.holding import HeldFormatError
from pipeline.steps.train.placement import Device, PlacementError, plan, target_units

RELEASE = REPO / "tests" / "fixtures" / "glm5_nvfp4"
SHIPPED = json.loads((RELEASE / "config.json").read_text())
# Bytes a weight as stored: half a byte of e2m1, an fp8 scale per 16 (the fp32 global scale and
# input scale are 8 bytes a tensor).
NVFP4_BYTES = 0.5 + 1 / 16
# The seeds' host: 8 RTX PRO 6000 Blackwell (sm_120) of 96 GB, 1 GiB each for the CUDA context.
HOST = [Device(f"cuda:{i}", 96 * 10**9 - 1024**3) for i in range(8)]


def small() -> GlmMoeDsaConfig:
    """The release's config at a size a test builds in a moment: its layout (dense first layers,
    routed and shared experts, the indexer) and its quantization as shipped."""
    sizes = {
        "vocab_size": 4096,
        "hidden_size": 256,
        "intermediate_size": 768,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 48,
        "v_head_dim": 64,
        "head_dim": 16,
        "index_head_dim": 32,
        "index_n_heads": 4,
        "index_topk": 64,
        "max_position_embeddings": 4096,
    }
    return GlmMoeDsaConfig(**{**SHIPPED, **sizes})


def dense(config) -> GlmMoeDsaConfig:
    unquantized = config.to_dict()
    del unquantized["quantization_config"]
    return GlmMoeDsaConfig(**unquantized)


def units(config, device_type: str = "cuda", capability=(12, 0), **kwargs):
    return target_units(
        config, torch.bfloat16, 1, 64, 256, 64, device_type=device_type, capability=capability, **kwargs
    )


def routed_expert_weights(config) -> int:
    layers = config.num_hidden_layers - config.first_k_dense_replace
    return layers * config.n_routed_experts * 3 * config.moe_intermediate_size * config.hidden_size


@pytest.mark.parametrize("capability", [(10, 0), (12, 0)], ids=["sm_100", "sm_120"])
def test_on_a_blackwell_gpu_the_experts_are_planned_at_their_stored_bytes(capability):
    config = small()
    stored, bf16 = units(config, capability=capability), units(dense(config))
    assert stored.holding == "stored"
    saved = sum(u.weights for u in bf16) - sum(u.weights for u in stored)
    assert saved == int(routed_expert_weights(config) * (2 - NVFP4_BYTES))
    # What the checkpoint leaves in bf16 stays at 2 bytes a weight: the dense first layers whole,
    # and every layer's attention, indexer and shared expert.
    for held, full in zip(stored, bf16, strict=True):
        layer = held.module.removeprefix("model.layers.")
        if not layer.isdigit() or int(layer) < config.first_k_dense_replace:
            assert held.weights == full.weights, held.module


@pytest.mark.parametrize(
    ("device_type", "capability", "where"),
    [("cuda", (9, 0), "cuda (sm_90)"), ("cuda", (8, 9), "cuda (sm_89)"), ("cpu", None, "cpu")],
)
def test_anywhere_else_nvfp4_is_refused_up_front_with_its_dense_size(device_type, capability, where):
    config = small()
    bf16 = sum(u.weights for u in units(dense(config), "cpu", None))
    with pytest.raises(HeldFormatError) as refused:
        units(config, device_type, capability)
    message = str(refused.value)
    assert "\n" not in message
    assert "'NVFP4 (modelopt)'" in message and f"held as stored on {where}:" in message
    assert "Blackwell" in message
    assert f"dequantized it would need {format_size(bf16)}" in message


def test_the_release_fits_the_seeds_host_only_as_stored():
    config = AutoConfig.from_pretrained(RELEASE)
    assert isinstance(config, GlmMoeDsaConfig) and config.quantization_config["quant_algo"] == "NVFP4"
    stored = target_units(
        config, torch.bfloat16, 1, 4096, 32000, 1024, device_type="cuda", capability=(12, 0)
    )
    # The model cards give ~440 GB of NVFP4 weights (57 GB per GPU over 8).
    assert 420e9 < sum(u.weights for u in stored) < 460e9
    sharded = plan("sharded", stored, HOST, 0, 1)
    assert len(sharded.shares) == 8 and sharded.holding == "stored"
    bf16 = target_units(config, torch.bfloat16, 1, 4096, 32000, 1024, device_type="cuda", dequantize=True)
    assert sum(u.weights for u in bf16) > 1.4e12  # 744B parameters
    with pytest.raises(PlacementError):
        plan("sharded", bf16, HOST, 0, 1)


def test_its_weights_are_not_read_as_if_they_were_bf16(tmp_path):
    """No loader here reads ModelOpt's tensors (transformers 5.x loads no pre-quantized NVFP4):
    the step says so in one line before any weight is read, also when asked to dequantize."""
    shutil.copy(RELEASE / "config.json", tmp_path / "config.json")
    for dequantize in (False, True):
        with pytest.raises(TargetError, match=r"stored by ModelOpt \(NVFP4\).*modelopt_fp4") as refused:
            load_model(tmp_path, dtype=torch.bfloat16, trust_remote_code=False, dequantize=dequantize)
        assert "\n" not in str(refused.value)
