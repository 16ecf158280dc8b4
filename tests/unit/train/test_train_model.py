"""The draft model's pieces against slow, obvious references: TTT attention, vocab map, export, decoding."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from eyrie_testing import perturbed_draft
from pipeline.steps.eagle3 import decoding
from pipeline.steps.eagle3.attention import ttt_attention
from pipeline.steps.eagle3.decoding import ChainDecoder, eos_ids_of, propose, real_acceptance
from pipeline.steps.eagle3.export import export_draft, load_draft
from pipeline.steps.eagle3.model import vocab_map
from pipeline.steps.shards import Example
from pipeline.steps.train.features import OnlineTarget
from pipeline.steps.train.loop import simulated_acceptance


def reference_ttt_attention(q, keys, values):
    """Every (step, position) key laid out flat, with an explicit boolean visibility matrix."""
    B, h, T, d = q.shape
    k = len(keys) - 1
    flat_k = torch.cat(keys, dim=2)  # (B, h, (k+1)T, d): step j's key at p sits at j*T + p
    flat_v = torch.cat(values, dim=2)
    visible = torch.zeros(T, (k + 1) * T, dtype=torch.bool)
    for p in range(T):
        for step in range(k + 1):
            for pos in range(T):
                if (step == 0 and pos <= p) or (step >= 1 and pos == p):
                    visible[p, step * T + pos] = True
    scores = q @ flat_k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ flat_v


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_ttt_attention_matches_reference(steps):
    torch.manual_seed(steps)
    B, h, T, d = 2, 3, 7, 8
    q = torch.randn(B, h, T, d, dtype=torch.float64)
    keys = [torch.randn(B, h, T, d, dtype=torch.float64) for _ in range(steps)]
    values = [torch.randn(B, h, T, d, dtype=torch.float64) for _ in range(steps)]
    out = ttt_attention(q, keys, values)
    assert out.shape == (B, h, T, d)
    torch.testing.assert_close(out, reference_ttt_attention(q, keys, values), rtol=1e-10, atol=1e-10)


def test_ttt_attention_ignores_other_positions_of_later_steps():
    """Changing a step-1 key/value at position 3 must change only the query at position 3."""
    torch.manual_seed(0)
    q, k0, v0, k1, v1 = (torch.randn(1, 2, 6, 4) for _ in range(5))
    before = ttt_attention(q, [k0, k1], [v0, v1])
    k1b, v1b = k1.clone(), v1.clone()
    k1b[:, :, 3] += 1.0
    v1b[:, :, 3] += 1.0
    after = ttt_attention(q, [k0, k1b], [v0, v1b])
    changed = (before - after).abs().amax(dim=(0, 1, 3)) > 0
    assert changed.tolist() == [False, False, False, True, False, False]


def test_vocab_map_round_trip():
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 7, 3, 0, 2])
    d2t, t2d = vocab_map(counts, 5)
    kept = d2t + torch.arange(5)
    # The most frequent five, ties to the lower id, ascending.
    assert kept.tolist() == [0, 2, 3, 6, 7]
    assert t2d.tolist() == [i in (0, 2, 3, 6, 7) for i in range(10)]
    # target -> draft -> target is the identity on kept ids
    target_to_draft = torch.cumsum(t2d.long(), 0) - 1
    for t in kept.tolist():
        d = int(target_to_draft[t])
        assert int(d + d2t[d]) == t
    assert bool(t2d[kept].all()) and int(t2d.sum()) == 5


def test_vocab_map_smaller_vocab_than_draft_keeps_everything():
    d2t, t2d = vocab_map(torch.tensor([0, 3, 1]), 32000)
    assert d2t.tolist() == [0, 0, 0] and t2d.all()


def _tiny_target(seed=0, vocab=96, layers=6):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=1,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def _draft_for(target, draft_vocab=48, layer_ids=(0, 2, 3)):
    return perturbed_draft(target, draft_vocab, layer_ids)


def test_export_reload_gives_identical_logits(tmp_path):
    target = _tiny_target()
    draft = _draft_for(target)
    folder = export_draft(draft, tmp_path / "draft", [0, 2, 3], dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 48 and config["vocab_size"] == 96
    assert config["hidden_size"] == config["target_hidden_size"] == 32
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    assert config["num_hidden_layers"] == 1
    keys = set(load_file(folder / "model.safetensors"))
    expected = {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        "midlayer.input_layernorm.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.post_attention_layernorm.weight",
        *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    }
    assert keys == expected
    weights = load_file(folder / "model.safetensors")
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    assert (
        weights["fc.weight"].shape == (32, 96) and weights["midlayer.self_attn.q_proj.weight"].shape[1] == 64
    )

    reloaded = load_draft(folder, target.get_input_embeddings().weight)
    torch.manual_seed(3)
    tokens = torch.randint(0, 96, (2, 10))
    features = torch.randn(2, 10, 96)
    with torch.no_grad():
        a = [draft.logits(o) for o in draft(tokens, features, 3)]
        b = [reloaded.logits(o) for o in reloaded(tokens, features, 3)]
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_chain_proposal_equals_training_time_test_step():
    """What the decoding loop proposes at depth j is what TTT step j computes for the same chain."""
    target = _tiny_target()
    draft = _draft_for(target)
    torch.manual_seed(4)
    ids = torch.randint(2, 96, (12,)).tolist()
    with torch.no_grad():
        out = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
        features = torch.cat([out.hidden_states[i + 1] for i in (0, 2, 3)], dim=-1)
        drafts = propose(draft, ids, features[:, :-1], 4)
        # Teacher-force the chain: tokens after the last position are the drafts themselves.
        tokens = torch.tensor([ids[1:] + drafts])
        outs = draft(tokens, torch.cat([features[:, :-1], features[:, :1].expand(1, 4, -1)], 1), 4)
    n = len(ids) - 2  # the last position with a real feature
    chained = [int(draft.draft_to_target(draft.logits(o[:, n]).argmax(-1))) for o in outs]
    assert chained == drafts


def test_speculative_decoding_is_lossless():
    target = _tiny_target(seed=5)
    draft = _draft_for(target)
    prompt = [5, 17, 33, 8, 61, 2]
    generated, per_forward = ChainDecoder(target, draft).generate(prompt, k=4, max_new_tokens=30, eos_ids={1})
    with torch.no_grad():
        greedy = target.generate(
            torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=1, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert generated == greedy
    assert sum(per_forward) == len(generated) - 1
    assert all(1 <= n <= 5 for n in per_forward)


def test_lossless_at_every_acceptance_length_from_0_to_k(monkeypatch):
    """A drafter that proposes the target's own greedy tokens with one corrupted at a random depth
    (or none): each verifying forward accepts exactly that depth, every depth 0..K occurs, and the
    output is still the target's greedy output."""
    target = _tiny_target(seed=5)
    draft = _draft_for(target)
    k, prompt, new_tokens = 4, [5, 17, 33, 8, 61, 2], 160
    rng = random.Random(0)
    depths: list[int] = []

    def greedy_after(ids: list[int], steps: int) -> list[int]:
        # An explicit mask: generate would otherwise take a generated 0 (the pad id) for padding.
        tokens = torch.tensor([ids])
        with torch.no_grad():
            out = target.generate(
                tokens,
                attention_mask=torch.ones_like(tokens),
                max_new_tokens=steps,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return out[0, len(ids) :].tolist()

    def own_tokens_one_corrupted(_draft, ids, _features, steps, cache=None, head=None):
        own = greedy_after(ids, steps)
        depth = rng.randint(0, steps)  # steps: nothing corrupted, the whole chain is the target's
        depths.append(depth)
        if depth < steps:
            own[depth] = (own[depth] + 1) % target.config.vocab_size
        return own

    monkeypatch.setattr(decoding, "propose", own_tokens_one_corrupted)
    generated, per_forward = ChainDecoder(target, draft).generate(prompt, k, new_tokens, eos_ids=set())
    assert generated == greedy_after(prompt, new_tokens)
    accepted = [n - 1 for n in per_forward[:-1]]  # the last forward may be cut at max_new_tokens
    assert accepted == depths[: len(accepted)]
    assert set(accepted) == set(range(k + 1))


def test_fp32_draft_is_evaluated_on_a_bf16_target():
    """On a GPU the target is loaded in bf16, the draft trains in fp32; evaluation runs without autocast."""
    target = _tiny_target()
    draft = _draft_for(target)
    target = target.to(torch.bfloat16)
    torch.manual_seed(6)
    rows = [Example(torch.randint(2, 96, (16,)).tolist(), [0] * 6 + [1] * 10, "") for _ in range(3)]
    source = OnlineTarget(target, [0, 2, 3], draft.d2t, draft.t2d)
    simulated = simulated_acceptance(source, draft, rows, 3, 0, batch_size=2, loss_chunk=8, precision="fp32")
    assert len(simulated["acc"]) == 3 and simulated["acceptance_length"] >= 1.0
    real = real_acceptance(target, draft, rows, 3, max_new_tokens=8, eos_ids={1})
    assert real["verify_forwards"] > 0


def test_no_held_out_prompt_decodes_nothing_and_needs_no_target():
    """train with --eval-prompts 0 (or no held-out row) loads no target for evaluation."""
    draft = _draft_for(_tiny_target())
    real = real_acceptance(None, draft, [], 3, max_new_tokens=8, eos_ids=())
    assert real == {"prompts": 0, "verify_forwards": 0, "acceptance_length": None}


def test_simulated_acceptance_holds_what_a_training_step_holds(monkeypatch):
    """After training, held-out rows go through in training's batches and its loss chunks: the
    placement planned that much (the logits of a whole batch at once could run out of memory after
    a training that fit)."""
    target = _tiny_target()
    draft = _draft_for(target)
    torch.manual_seed(6)
    rows = [Example(torch.randint(2, 96, (16,)).tolist(), [0] * 6 + [1] * 10, "") for _ in range(7)]
    source = OnlineTarget(target, [0, 2, 3], draft.d2t, draft.t2d)
    batches, positions = [], []
    draft.lm_head.register_forward_hook(lambda module, args, out: positions.append(args[0].shape[1]))

    def counted(input_ids, attention_mask):
        batches.append(input_ids.shape[0])
        return source(input_ids, attention_mask)

    chunked = simulated_acceptance(counted, draft, rows, 3, 0, batch_size=3, loss_chunk=5, precision="fp32")
    assert batches == [3, 3, 1] and max(positions) <= 5
    whole = simulated_acceptance(
        source, draft, rows, 3, 0, batch_size=7, loss_chunk=1 << 30, precision="fp32"
    )
    assert chunked["acc"] == pytest.approx(whole["acc"])


def test_decoding_stops_at_any_of_several_end_tokens():
    """Llama 3 and Qwen3 list several end-of-sequence ids in their generation config."""
    target = _tiny_target(seed=5)
    draft = _draft_for(target)
    prompt = [5, 17, 33, 8, 61, 2]
    with torch.no_grad():
        free = target.generate(
            torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    stop = free[6]  # the target's own 7th token ends the answer
    first = free.index(stop)
    target.generation_config.eos_token_id = [95, stop]
    assert eos_ids_of(target) == {95, stop}
    generated, per_forward = ChainDecoder(target, draft).generate(prompt, 4, 30, eos_ids_of(target))
    assert generated == free[: first + 1]
    with torch.no_grad():
        greedy = target.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, pad_token_id=0)
    assert generated == greedy[0, len(prompt) :].tolist()
    assert sum(per_forward) == len(generated) - 1


def test_eos_ids_of_one_id_or_none():
    target = _tiny_target()
    target.generation_config.eos_token_id = None
    assert eos_ids_of(target) == {1}  # from the model config
    target.config.eos_token_id = None
    assert eos_ids_of(target) == frozenset()
