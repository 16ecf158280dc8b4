"""Kimi-K2.5's own config.json (tests/fixtures/kimi_k25_release/, no weights): transformers loads it
with its own ``kimi_k25`` classes, no remote code, as the target's language model and its
quantization; the planner (benchmarks/placement_arithmetic.py) accepts it on the seeds' host."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoConfig, DeepseekV3Config

from benchmarks.placement_arithmetic import KIMI_K25_RELEASE, kimi_plan
from eyrie_testing import docs_page
from pipeline.steps.train.placement import Device, PlacementError

GiB = 1024**3
SHIPPED = json.loads((KIMI_K25_RELEASE / "config.json").read_text())


def test_the_release_loads_without_its_remote_code():
    # The file keeps Kimi's auto_map (its own configuration_kimi_k25.py, not shipped here): with a
    # kimi_k25 class of its own, transformers uses that one and runs nothing from the folder.
    assert SHIPPED["auto_map"]["AutoConfig"] == "configuration_kimi_k25.KimiK25Config"
    config = AutoConfig.from_pretrained(KIMI_K25_RELEASE, trust_remote_code=False)
    assert type(config).__module__.startswith("transformers.models.kimi_k25.")
    assert config.architectures == ["KimiK25ForConditionalGeneration"] and not config.tie_word_embeddings
    # The release names its language model kimi_k2 (its remote code's); transformers reads DeepSeek-V3.
    assert SHIPPED["text_config"]["model_type"] == "kimi_k2"
    assert isinstance(config.text_config, DeepseekV3Config)


def test_its_language_model_is_deepseek_v3_shaped():
    text = AutoConfig.from_pretrained(KIMI_K25_RELEASE).text_config
    shape = {
        "num_hidden_layers": 61,
        "first_k_dense_replace": 1,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 384,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "vocab_size": 163840,
        "max_position_embeddings": 262144,
        "routed_scaling_factor": 2.827,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
    }
    assert {name: getattr(text, name) for name in shape} == shape
    rope = text.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["rope_theta"]) == ("yarn", 64.0, 50000.0)
    yarn = (rope["original_max_position_embeddings"], rope["beta_fast"], rope["beta_slow"])
    assert yarn == (4096, 32.0, 1.0)


def test_its_routed_experts_are_int4_in_groups_of_32():
    quantization = AutoConfig.from_pretrained(KIMI_K25_RELEASE).text_config.quantization_config
    assert (quantization["quant_method"], quantization["format"]) == ("compressed-tensors", "pack-quantized")
    (group,) = quantization["config_groups"].values()
    weights = group["weights"]
    assert (weights["type"], weights["num_bits"], weights["symmetric"]) == ("int", 4, True)
    assert (weights["strategy"], weights["group_size"]) == ("group", 32)
    # Every Linear but these: attention, shared experts, the dense layer's MLP and the lm_head stay bf16.
    assert quantization["ignore"] == [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    ]


def test_the_planner_accepts_kimi_k25_on_the_seeds_host_sharded_and_offline():
    sharded, units = kimi_plan("sharded")
    assert units.holding == "packed" and units.left_out > 0  # the vision tower, never loaded
    devices = sharded.as_dict()["devices"]
    assert len(devices) == 8 and sum(len(d["layers"]) for d in devices) == 61
    for device in devices:  # every GPU within its usable share, the experts held packed
        assert 0 < device["planned_bytes"] <= Device("cuda", device["free_bytes"]).usable
        assert device["packed_bytes"] > device["dense_bytes"] and device["transient_bytes"] > 0
    weights = sum(d["weight_bytes"] for d in devices)
    assert 540 * GiB < weights < 570 * GiB  # ~595 GB as stored: packed experts and scales, bf16 rest
    offline, _ = kimi_plan("offline")
    assert offline.placement == "offline" and len(offline.features.shares) == 8
    with pytest.raises(PlacementError):
        kimi_plan("replicated")
    with pytest.raises(PlacementError, match="TiB"):  # dequantized, ~2 TB: what transformers alone would hold
        kimi_plan("sharded", dequantize=True)


def docs_kimi_block() -> dict[str, str]:
    """The settings the Kimi-K2.5 block of docs/gpu-host.md exports, as written."""
    text = docs_page("gpu-host")
    opening = text.index("```", text.index("The real job on Kimi-K2.5"))
    block = text[opening + 3 : text.index("```", opening + 3)]
    return dict(re.findall(r"^export (\w+)=(\S+)", block, flags=re.M))


def test_the_docs_block_as_written_passes_the_planner_at_its_own_length():
    settings = docs_kimi_block()
    length = int(settings["EYRIE_MAX_LENGTH"])  # stated, not left to the pipeline's default
    assert length >= 4096
    result, _ = kimi_plan(settings["EYRIE_TARGET_PLACEMENT"], length)
    assert result.placement == settings["EYRIE_TARGET_PLACEMENT"]


def test_rows_of_32768_tokens_train_offline_and_a_sharded_refusal_gives_the_real_reason():
    offline, _ = kimi_plan("offline", 32768)
    assert offline.placement == "offline"
    assert offline.shares[0].planned <= offline.shares[0].device.usable
    with pytest.raises(PlacementError) as refused:
        kimi_plan("sharded", 32768)
    message = str(refused.value)
    # The sum fits the 8 GPUs: what does not is whole layers beside the draft, and the numbers say so.
    needed, usable = (
        float(x) for x in re.search(r"need ([\d.]+) GiB, under the ([\d.]+) GiB", message).groups()
    )
    assert needed < usable
    assert "modules go whole and in order" in message and "left over" in message and "\n" not in message


def test_a_draft_larger_than_the_first_gpu_is_named_as_the_reason():
    with pytest.raises(
        PlacementError, match=r"^the draft needs [\d.]+ GiB on cuda:0, which has 83.99 GiB usable"
    ):
        kimi_plan("sharded", 65536)
