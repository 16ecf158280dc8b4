"""The target is named by a hub id or a folder; either way a wrong name is one line."""

from __future__ import annotations

import pytest
import torch

from pipeline.steps.target import TargetError, check_target, load_model


def test_a_hub_id_is_accepted_and_a_missing_folder_or_odd_name_is_not(tmp_path):
    check_target("Qwen/Qwen3-8B", "--target")
    check_target("moonshotai/Kimi-K2.5", "--target")
    with pytest.raises(TargetError, match=r"--target \./nope does not exist"):
        check_target("./nope", "--target")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TargetError, match="not a Hugging Face model folder"):
        check_target(tmp_path / "empty", "--target")
    with pytest.raises(TargetError, match="neither a model folder nor a hub id"):
        check_target("two words/x y", "--target")


def test_a_hub_id_that_cannot_be_fetched_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # and not in this machine's cache
    with pytest.raises(TargetError) as info:
        load_model("eyrie-tests/no-such-model", dtype=torch.float32, trust_remote_code=False)
    message = str(info.value)
    assert message.startswith("--target eyrie-tests/no-such-model: cannot load the model:")
    assert "\n" not in message


def test_flash_attention_is_chosen_only_where_its_kernels_run(monkeypatch):
    import importlib.util

    from pipeline.steps.target import attention_for

    installed = importlib.util.find_spec("flash_attn") is not None
    assert attention_for("cuda", torch.bfloat16) == ("flash_attention_2" if installed else "sdpa")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "flash_attn" else None)
    assert attention_for("cuda", torch.bfloat16) == "flash_attention_2"
    assert attention_for("cuda", torch.float16) == "flash_attention_2"
    assert attention_for("cuda", torch.float32) == "sdpa"  # flash-attn has no fp32 kernels
    assert attention_for("cpu", torch.bfloat16) == "sdpa"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert attention_for("cuda", torch.bfloat16) == "sdpa"


def test_a_target_that_cannot_take_flash_attention_keeps_sdpa():
    from pipeline.embedded.tiny import ensure_tiny_target
    from pipeline.steps.target import use_attention

    model = load_model(ensure_tiny_target(), dtype=torch.float32, trust_remote_code=False)
    assert model.config._attn_implementation == "sdpa"
    # flash-attn is not installed here (and runs on no CPU): the model stays as it was.
    assert use_attention(model, "flash_attention_2") == "sdpa"
    assert use_attention(model, "eager") == "eager" == model.config._attn_implementation
