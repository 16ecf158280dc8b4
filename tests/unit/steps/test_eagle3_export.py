"""The export SGLang reads the way the trainer meant it: RoPE scaling, activation, feature layers, shapes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pipeline.steps.eagle3.export import WEIGHTS, export_draft, load_draft
from pipeline.steps.eagle3.model import Eagle3Draft, draft_config

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 50000.0,
    "factor": 32.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}


def _target(**overrides) -> LlamaConfig:
    values = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=1,
        pad_token_id=0,
    )
    return LlamaConfig(**{**values, **overrides})


def _export(tmp_path, target, layer_ids=(0, 2, 3)):
    draft = Eagle3Draft(draft_config(target, 48, list(layer_ids)))
    folder = export_draft(draft, tmp_path / "draft", list(layer_ids), dtype=torch.float32)
    return draft, folder, json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("rope", [LLAMA3, YARN], ids=["llama3", "yarn"])
def test_scaled_rope_is_written_for_transformers_4_and_5_readers(tmp_path, rope):
    target = _target(rope_parameters=dict(rope))
    draft, _, config = _export(tmp_path, target)
    assert config["rope_parameters"] == rope
    assert config["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
    assert config["rope_theta"] == rope["rope_theta"]
    # the draft's rotation is the target's, scaled the same way, before and after the round trip
    positions = torch.arange(0, 2048, 97)[None]
    x = torch.zeros(1, positions.shape[1], 64)
    want = LlamaRotaryEmbedding(target)(x, positions)
    reread = Eagle3Draft(LlamaConfig(**config))
    for rotary in (draft.rotary, reread.rotary):
        got = rotary(x, positions)
        assert all(torch.allclose(a, b) for a, b in zip(got, want, strict=True))
    plain = LlamaRotaryEmbedding(_target())(x, positions)
    assert not torch.allclose(want[0], plain[0])  # the scaling matters at these positions


def test_plain_rope_writes_no_scaling(tmp_path):
    _, _, config = _export(tmp_path, _target())
    assert config["rope_scaling"] is None
    assert config["rope_parameters"]["rope_type"] == "default"


def test_an_activation_sglang_cannot_run_is_refused_before_training():
    with pytest.raises(ValueError, match="hidden_act is 'gelu'.*runs only silu"):
        draft_config(_target(hidden_act="gelu"), 48, [0, 2, 3])


def test_the_layers_trained_on_must_be_the_layers_the_config_states(tmp_path):
    draft = Eagle3Draft(draft_config(_target(), 48, [0, 2, 3]))
    expected = r"trained on target layers \[1, 2, 3\] but its config states \[0, 2, 3\]"
    with pytest.raises(ValueError, match=expected):
        export_draft(draft, tmp_path / "draft", [1, 2, 3])
    assert not (tmp_path / "draft").exists()
    _, _, config = _export(tmp_path, _target())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]  # vLLM's place


def test_an_mla_target_gets_grouped_query_attention_not_its_latent_layout():
    kimi_like = DeepseekV3Config(
        vocab_size=512,
        hidden_size=7168,
        intermediate_size=18432,
        num_hidden_layers=61,
        num_attention_heads=64,
        num_key_value_heads=64,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
    )
    config = draft_config(kimi_like, 32000, [1, 29, 57])
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (56, 8, 128)
    # per token, the draft's KV cache holds 2 x 8 x 128 values instead of 2 x 64 x 64
    assert 2 * config.num_key_value_heads * config.head_dim * 4 == 2 * 64 * kimi_like.head_dim
    assert config.hidden_size == 7168 and config.target_hidden_size == 7168
    narrow = DeepseekV3Config(
        vocab_size=128,
        hidden_size=32,
        num_attention_heads=4,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        num_hidden_layers=4,
    )
    config = draft_config(narrow, 64, [0, 1, 2])
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 4, 8)


def test_the_draft_loads_strictly_and_refuses_a_folder_with_other_tensors(tmp_path):
    draft, folder, _ = _export(tmp_path, _target())
    embedding = torch.randn(96, 64)
    loaded = load_draft(folder, embedding)
    assert torch.equal(loaded.embed_tokens.weight, embedding)
    assert torch.equal(loaded.fc.weight, draft.fc.weight)
    weights = load_file(folder / WEIGHTS)
    save_file({**weights, "midlayer.extra.weight": torch.zeros(2)}, folder / WEIGHTS)
    with pytest.raises(ValueError, match="not a draft this class loads.*midlayer.extra.weight"):
        load_draft(folder, embedding)
    del weights["norm.weight"]
    save_file(weights, folder / WEIGHTS)
    with pytest.raises(ValueError, match="norm.weight"):
        load_draft(folder, embedding)


def test_the_train_step_refuses_such_a_target_before_reading_its_weights(tmp_path):
    from pipeline.steps.train.cli import check_inputs
    from pipeline.steps.train.config import SettingsError
    from pipeline.steps.train.loop import TrainConfig

    _target(hidden_act="gelu").save_pretrained(tmp_path / "target")  # a config, no weights at all
    (tmp_path / "shards").mkdir()
    cfg = TrainConfig(data=tmp_path / "shards", target=tmp_path / "target")
    with pytest.raises(SettingsError, match=r"--target .*target: the target's hidden_act is 'gelu'"):
        check_inputs(cfg)
