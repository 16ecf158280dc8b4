"""Checkpoints keep what training changes, and a killed write leaves nothing behind for long."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from pipeline.steps.eagle3.model import Eagle3Draft, draft_config
from pipeline.steps.train import checkpoint as ckpt


def _draft() -> Eagle3Draft:
    target = LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return Eagle3Draft(draft_config(target, 64, [1, 2, 3]))


def test_the_temporary_folder_of_a_killed_write_is_removed_by_the_next_save(tmp_path):
    # What a kill -9 during torch.save leaves: atomic_path's temporary folder, half written.
    leftover = tmp_path / ".step-00000004.tmp-4242"
    leftover.mkdir(parents=True)
    (leftover / "state.pt").write_bytes(b"\x80\x02torn")
    other = tmp_path / ".notes.tmp-1"  # not a checkpoint's: left alone
    other.mkdir()

    ckpt.save(tmp_path, 6, {"draft": {"w": torch.ones(1)}}, {"total_steps": 10})

    assert not leftover.exists() and other.exists()
    assert [p.name for p in ckpt.complete(tmp_path)] == ["step-00000006"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".notes.tmp-1", "step-00000006"]


def test_the_frozen_embedding_is_not_saved_and_a_resume_restores_the_rest(tmp_path):
    draft = _draft()
    state = ckpt.trained_state(draft)
    assert "embed_tokens.weight" not in state
    assert {"fc.weight", "lm_head.weight", "d2t", "t2d"} <= state.keys()
    ckpt.save(tmp_path, 2, {"draft": state}, {"total_steps": 4})
    # The embedding is 512 x 32 floats: the saved file holds the trained weights only.
    saved = torch.load(tmp_path / "step-00000002" / "state.pt", weights_only=False)["draft"]
    assert saved.keys() == state.keys()

    resumed = _draft()  # other random weights, the same (target's) embedding
    with torch.no_grad():
        resumed.embed_tokens.weight.copy_(draft.embed_tokens.weight)
    ckpt.restore(resumed, ckpt.load(tmp_path, 2)["draft"])
    for name, tensor in draft.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


def test_a_checkpoint_of_another_draft_is_refused(tmp_path):
    state = ckpt.trained_state(_draft())
    del state["fc.weight"]
    with pytest.raises(ValueError, match=r"checkpoint does not match the draft: missing \['fc.weight'\]"):
        ckpt.restore(_draft(), state)
