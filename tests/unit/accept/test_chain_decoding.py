"""The chain decoder on its caches against the loop without any: the same tokens and the same tokens
per verifying forward; each forward runs only the new tokens; the baseline is the target's greedy
``generate``. On tiny random targets, whose vocabulary is small enough that an untrained draft is
right often enough for every accept count 0..K to occur."""

from __future__ import annotations

import collections
import types

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.integrations import sdpa_attention

from eyrie_testing import perturbed_draft
from pipeline.steps.accept.measure import acceptance_rates
from pipeline.steps.eagle3 import decoding
from pipeline.steps.eagle3.decoding import (
    ChainDecoder,
    FewRowProducts,
    GroupedAttention,
    RowHead,
    greedy_generate,
    sdpa_grouped_kv,
)
from pipeline.steps.eagle3.model import Eagle3Draft, aux_layer_ids


def _target(vocab: int, seed: int):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=1,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def _draft(target, seed: int) -> Eagle3Draft:
    return perturbed_draft(target, layer_ids=(0, 1, 2), seed=seed)


def _prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(2, vocab, (length,), generator=generator).tolist() for length in (5, 8, 11)]


@torch.no_grad()
def uncached_propose(draft: Eagle3Draft, ids: list[int], features: torch.Tensor, k: int) -> list[int]:
    """The chain as training-time test computes it, the whole sequence again at every depth;
    ``features`` covers ``ids[:-1]``."""
    n = len(ids) - 1
    padded = torch.cat([features[:, :n], features.new_zeros(1, k - 1, features.shape[-1])], dim=1)
    drafts: list[int] = []
    for depth in range(k):
        # Step ``depth`` at the last position p reads the token at p + depth: the previous draft.
        tokens = torch.tensor([ids[1:] + drafts + [0] * (k - 1 - depth)])
        out = draft(tokens, padded, depth + 1)[depth]
        drafts.append(int(draft.draft_to_target(draft.logits(out[:, n - 1]).argmax(-1))))
    return drafts


@torch.no_grad()
def uncached_generate(target, draft, prompt: list[int], k: int, max_new_tokens: int, eos_ids=frozenset()):
    """The loop without caches: the target recomputes the whole sequence at every forward."""
    layer_ids = aux_layer_ids(draft.config)

    def whole(ids: list[int]):
        out = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
        features = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
        return out.logits[0].argmax(-1).tolist(), features

    argmax, features = whole(prompt)
    ids, generated, per_forward = prompt + [argmax[-1]], [argmax[-1]], []
    while len(generated) < max_new_tokens and generated[-1] not in eos_ids:
        drafts = uncached_propose(draft, ids, features, k)
        argmax, features = whole(ids + drafts)
        base, accepted = len(ids) - 1, 0
        while (
            accepted < k and drafts[accepted] == argmax[base + accepted] and drafts[accepted] not in eos_ids
        ):
            accepted += 1
        new = (drafts[:accepted] + [argmax[base + accepted]])[: max_new_tokens - len(generated)]
        per_forward.append(len(new))
        ids += new
        generated += new
    return generated, per_forward


@pytest.mark.parametrize(
    ("vocab", "target_seed", "draft_seed", "k"), [(4, 1, 2, 3), (6, 0, 0, 4), (6, 0, 1, 1)]
)
def test_the_cached_loop_gives_the_uncached_loops_tokens_and_accept_counts(vocab, target_seed, draft_seed, k):
    target = _target(vocab, target_seed)
    draft = _draft(target, draft_seed)
    counts = collections.Counter()
    for prompt in _prompts(vocab):
        cached = ChainDecoder(target, draft).generate(prompt, k, 40, frozenset())
        assert cached == uncached_generate(target, draft, prompt, k, 40)
        counts.update(cached[1])
    if (vocab, target_seed, draft_seed) == (4, 1, 2):
        # Every accept count 0..K occurred: the draft's cache grew by each of 1..K+1 positions.
        assert set(counts) == set(range(1, k + 2)), counts


def test_a_verifying_forward_runs_only_the_new_tokens_on_both_caches():
    """The target forwards the last accepted token and the K drafts; the draft runs step 0 only at
    the positions accepted since its last proposal, and each chain step at one position."""
    target, k = _target(4, 1), 3
    draft = _draft(target, 2)
    seen = collections.defaultdict(list)
    hooked = {
        "target": target.model.embed_tokens,
        "step0": draft.fc,
        "query": draft.midlayer.self_attn.q_proj,
    }
    for name, module in hooked.items():
        module.register_forward_pre_hook(lambda _module, args, name=name: seen[name].append(args[0].shape[1]))
    prompt = _prompts(4)[2]
    tokens, per_forward = ChainDecoder(target, draft).generate(prompt, k, 40, frozenset())
    assert max(per_forward) > 1  # some drafts were accepted, so rounds add more than one position
    assert seen["target"] == [len(prompt)] + [k + 1] * len(per_forward)
    assert seen["step0"] == [len(prompt)] + per_forward[:-1]
    assert seen["query"] == [n for new in seen["step0"] for n in [new] + [1] * (k - 1)]


def test_the_targets_head_runs_only_at_the_positions_verification_reads(monkeypatch):
    """Position i's verdict is read only when the drafts before it were accepted: a round runs the
    head (a vocabulary wide) once per token it yields, not at all K + 1 positions."""
    target, k = _target(4, 1), 3
    draft = _draft(target, 2)
    rows = collections.Counter()
    run = RowHead.__call__

    def counted(head, hidden):
        rows["target" if head.linear is target.lm_head else "draft"] += hidden.numel() // hidden.shape[-1]
        return run(head, hidden)

    monkeypatch.setattr(decoding.RowHead, "__call__", counted)
    prompt = _prompts(4)[2]
    tokens, per_forward = ChainDecoder(target, draft).generate(prompt, k, 40, frozenset())
    assert max(per_forward) > 1 and min(per_forward) < k + 1  # rounds of several lengths
    # The prompt's last position, then each round's accepted drafts and the target's own token
    # (the last round's may be cut by max_new_tokens after they were read).
    assert sum(per_forward) <= rows["target"] - 1 <= sum(per_forward) + k
    assert rows["draft"] == k * len(per_forward)


@pytest.mark.parametrize("rows", [(), (3,)])
def test_a_row_head_gives_its_linear_layers_products(rows):
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(*rows, 16)
    head = RowHead(linear)
    assert head.columns is not None  # on the CPU the weight is kept transposed
    torch.testing.assert_close(head(hidden), linear(hidden))


@pytest.mark.parametrize("rows", [(1, 1), (1, 2), (1, 4), (5,), (1, 6), (1, 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_few_row_products_give_the_linear_layers_products_and_end_with_the_context(rows, bias):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 50, bias=bias), torch.nn.GELU(), torch.nn.Linear(50, 8, bias=bias)
    )
    hidden = torch.randn(*rows, 16)
    plain = model(hidden)
    products = FewRowProducts(model)
    assert len(products.linears) == 2
    with products:
        within = model(hidden)
    torch.testing.assert_close(within, plain)
    assert within.is_contiguous() and within.shape == plain.shape
    assert all("forward" not in linear.__dict__ for linear in products.linears)  # the class's own again


def test_a_verifying_forward_computes_its_few_rows_as_weight_by_rows(monkeypatch):
    """The target's layers run the K + 1 rows of a verifying forward as ``W @ x^T``, and the
    prompt's many rows, and the target's own ``generate``, as ``nn.Linear`` does."""
    target, k = _target(4, 1), 3
    draft = _draft(target, 2)
    shapes = collections.Counter()
    mm = torch.mm

    def counted(a, b, *args, **kwargs):
        if a is target.model.layers[0].mlp.down_proj.weight:
            shapes[b.shape[1]] += 1
        return mm(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "mm", counted)
    prompt = _prompts(4)[2]
    tokens, per_forward = ChainDecoder(target, draft).generate(prompt, k, 40, frozenset())
    assert shapes == {k + 1: len(per_forward)}
    greedy_generate(target, prompt, 8, frozenset())
    assert shapes == {k + 1: len(per_forward)}


def test_a_verifying_forward_hands_sdpa_the_key_value_heads_as_they_are(monkeypatch):
    """Under the mask of a verifying forward's K + 1 queries transformers' ``sdpa`` copies each key
    and value head once per query head sharing it; the loop's attention does not, and the target is
    left with its own attention after."""
    target, k = _target(4, 1), 3  # 4 query heads on 2 key-value heads
    draft = _draft(target, 2)
    assert target.config._attn_implementation == "sdpa"
    copied = collections.Counter()
    repeat = sdpa_attention.repeat_kv

    def counted(hidden, n_rep):
        copied[hidden.shape[-2]] += 1
        return repeat(hidden, n_rep)

    monkeypatch.setattr(sdpa_attention, "repeat_kv", counted)
    prompt = _prompts(4)[2]
    tokens, per_forward = ChainDecoder(target, draft).generate(prompt, k, 40, frozenset())
    assert copied == {} and max(per_forward) > 1
    assert target.config._attn_implementation == "sdpa"
    # The same forwards outside the loop: transformers' own attention copies them.
    cache = DynamicCache()
    target(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
    target(input_ids=torch.tensor([tokens[: k + 1]]), cache=cache, use_cache=True)
    assert copied


@pytest.mark.parametrize("queries", [1, 4])
def test_grouped_attention_gives_sdpas_outputs(queries):
    torch.manual_seed(0)
    module = types.SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    query, key, value = torch.randn(1, 6, queries, 8), torch.randn(1, 2, 11, 8), torch.randn(1, 2, 11, 8)
    mask = torch.ones(queries, 11, dtype=torch.bool).tril(11 - queries)[None, None]
    grouped, _ = sdpa_grouped_kv(module, query, key, value, mask, scaling=0.3)
    own, _ = sdpa_attention.sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(grouped, own)
    assert grouped.shape == (1, queries, 6, 8) and grouped.is_contiguous()


def test_grouped_attention_leaves_a_target_with_another_attention_as_it_is():
    config = _target(4, 1).config
    config._attn_implementation = "eager"
    with GroupedAttention(config):
        assert config._attn_implementation == "eager"
    config._attn_implementation = "sdpa"
    with GroupedAttention(config):
        assert config._attn_implementation == decoding.GROUPED_SDPA
    assert config._attn_implementation == "sdpa"


def test_a_decoder_makes_its_heads_once_for_every_prompt(monkeypatch):
    """The target's head, copied transposed (a vocabulary wide), is made when the decoder is, not
    once per prompt; each prompt gets a cache of its own."""
    target, k = _target(4, 1), 3
    draft = _draft(target, 2)
    made = []
    make = RowHead.__init__

    def counted(head, linear):
        made.append(linear)
        make(head, linear)

    monkeypatch.setattr(decoding.RowHead, "__init__", counted)
    decoder = ChainDecoder(target, draft)
    assert made == [target.lm_head, draft.lm_head]
    for prompt in _prompts(4):
        assert decoder.generate(prompt, k, 20, frozenset()) == uncached_generate(target, draft, prompt, k, 20)
    assert len(made) == 2


def test_the_baseline_is_the_targets_plain_greedy_generate_whatever_its_generation_config_says():
    target = _target(6, 0)
    draft = _draft(target, 0)
    prompt = _prompts(6)[1]
    own = target.generation_config
    own.do_sample, own.temperature, own.repetition_penalty = True, 0.7, 1.5
    expected, _ = uncached_generate(target, draft, prompt, 1, 30, frozenset({1}))
    assert greedy_generate(target, prompt, 30, {1}) == expected
    assert ChainDecoder(target, draft).generate(prompt, 4, 30, {1})[0] == expected
    assert target.generation_config is own


def test_acceptance_rate_per_position_is_the_share_of_forwards_that_kept_that_draft():
    # Tokens yielded per verifying forward with K = 3: 1 is no draft kept, 4 all three.
    assert acceptance_rates([1, 4, 2, 3], 3) == [0.75, 0.5, 0.25]
    assert acceptance_rates([1, 1], 2) == [0.0, 0.0]
