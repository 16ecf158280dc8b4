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
