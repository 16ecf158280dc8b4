"""A real speculative-decoding loop: the draft proposes a chain of K tokens, the target verifies greedily.

The output is exactly the target's greedy output (verification keeps only tokens the
target would have chosen, plus the target's own next token), so the loop is lossless;
what it measures is how many tokens each target forward yields: the acceptance length.

Both sides keep caches, so that a round costs what it costs when served: the target forwards
only the last accepted token and the K drafts on its KV cache (the rejected drafts are cropped
off after), and the draft runs its step 0 only at the positions accepted since its last proposal
(the keys and values of the earlier ones are kept) and its chain steps only at the last position.
The target's head, a vocabulary wide, runs only at the positions whose verdict is read: after
the last accepted token and after each draft it accepts. On a CPU the heads' one-row products and
the target's few-row ones take the shapes the CPU runs fastest (``RowHead``, ``FewRowProducts``),
and the verifying forward's attention reads the key and value heads without copying them
(``GroupedAttention``). A ``ChainDecoder`` makes all of it ready once for every prompt it decodes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache, GenerationConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pipeline.steps.eagle3.model import Eagle3Draft, aux_layer_ids

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Verifier:
    """The target made ready once for the verifying forwards of every prompt it decodes: its decoder
    without the head, its few-row products and grouped attention, its head kept transposed."""

    def __init__(self, target, layer_ids: list[int], device: torch.device):
        self.body = target.base_model  # the decoder without its head: the head runs where asked
        self.products = FewRowProducts(self.body)
        self.attention = GroupedAttention(self.body.config)
        self.head = RowHead(target.get_output_embeddings())  # a copy of the head: made once, not per prompt
        self.layer_ids = layer_ids
        self.device = device  # the draft's: the features are its input
        parameters = inspect.signature(self.body.forward).parameters
        # transformers 5.25 renamed the forward's ``past_key_values`` to ``cache`` (the old name warns).
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"


class TargetCache:
    """The target's KV cache of one prompt's tokens decoded so far, and the forwards that extend it."""

    def __init__(self, verifier: Verifier):
        self.verifier = verifier
        self.cache = DynamicCache()

    @torch.no_grad()
    def forward(self, tokens: list[int]) -> tuple[Verdicts, torch.Tensor]:
        """The target's greedy token after each of ``tokens``, computed when asked for, and their
        features; ``tokens`` join the cache."""
        verifier = self.verifier
        first = verifier.body.get_input_embeddings().weight.device
        kwargs = {verifier.cache_argument: self.cache, "use_cache": True, "output_hidden_states": True}
        with verifier.products, verifier.attention:
            out = verifier.body(input_ids=torch.tensor([tokens], device=first), **kwargs)
        layers = [out.hidden_states[i + 1].to(verifier.device) for i in verifier.layer_ids]
        features = torch.cat(layers, dim=-1)
        return Verdicts(verifier.head, out.last_hidden_state[0]), features

    def keep(self, length: int) -> None:
        """Forget every token after the first ``length`` (the drafts the target rejected)."""
        # transformers 5.25's crop takes the count to remove, negative; it refuses a length.
        self.cache.crop(length - self.cache.get_seq_length())


class RowHead:
    """A head (a linear layer) run on one position at a time. On a CPU its weight is kept
    transposed: a one-row product then reads the weight in the order it is stored, twice as fast
    as ``nn.Linear``'s (benchmarks/README.md, "Chain decoding")."""

    def __init__(self, linear):
        self.linear = linear
        plain = isinstance(linear, torch.nn.Linear) and linear.bias is None
        on_cpu = plain and linear.weight.device.type == "cpu"
        self.columns = linear.weight.detach().t().contiguous() if on_cpu else None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden) if self.columns is None else hidden @ self.columns


FEW_ROWS = range(2, 6)
"""The row counts at which ``W @ x^T`` beats ``nn.Linear`` on a CPU: K + 1 for K = 1..4."""


class FewRowProducts:
    """A model's fp32 linear layers on a CPU, computing a product on a few rows (a verifying
    forward's K + 1 tokens) as ``W @ x^T``. MKL runs ``nn.Linear``'s ``x @ W^T`` on 2 to 5 rows
    as a general product, 1.1-2.2x slower than this one, which reads the weight once
    (benchmarks/README.md, "Chain decoding"). A context: the layers compute so within it only,
    so that the model's own ``generate`` is left as it is."""

    def __init__(self, model: torch.nn.Module):
        self.linears = [
            module
            for module in model.modules()
            if type(module) is torch.nn.Linear
            and module.weight.device.type == "cpu"
            and module.weight.dtype == torch.float32
        ]

    def __enter__(self) -> None:
        for linear in self.linears:
            linear.forward = partial(_few_row_product, linear)

    def __exit__(self, *exc_info) -> None:
        for linear in self.linears:
            del linear.forward  # back to the class's own


def _few_row_product(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows not in FEW_ROWS:
        return F.linear(x, linear.weight, linear.bias)
    out = torch.mm(linear.weight, x.reshape(rows, -1).t()).t().contiguous()  # the rows' layout, as F.linear's
    if linear.bias is not None:
        out += linear.bias
    return out.view(*x.shape[:-1], -1)


GROUPED_SDPA = "sdpa_grouped_kv"
"""The attention a verifying forward runs in place of transformers' ``sdpa``."""


def sdpa_grouped_kv(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' ``sdpa`` attention, but under a mask too it hands SDPA the key and value heads
    as they are (``enable_gqa``). transformers' own copies them once per query head sharing them
    (``repeat_kv``) whenever there is a mask, as there is at a verifying forward's K + 1 queries; on
    a CPU that copy and the kernel SDPA then takes cost more than the attention itself, the more so
    the longer the context (benchmarks/README.md, "Chain decoding"). The same outputs."""
    plain = attention_mask is None or getattr(module, "num_key_value_groups", 1) == 1
    if plain or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, sdpa_grouped_kv)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # its masks are sdpa's


class GroupedAttention:
    """A context in which a target that runs transformers' ``sdpa`` attention runs
    :func:`sdpa_grouped_kv` instead; other attentions are left as they are, and so is the target's
    ``generate`` outside it."""

    def __init__(self, config):
        self.config = config
        self.own: str | None = None

    def __enter__(self) -> None:
        self.own = self.config._attn_implementation
        if self.own == "sdpa":
            self.config._attn_implementation = GROUPED_SDPA

    def __exit__(self, *exc_info) -> None:
        self.config._attn_implementation = self.own


class Verdicts:
    """The target's greedy token after each verified position, its head run on that position only
    when asked: a position after a rejected draft is never asked for. The argmax of the head on
    the decoder's last hidden state is the target's own (a final soft-cap or scale of its logits
    does not move it). On a CPU the head's product for all K + 1 positions costs more than a
    fifth of a one-token step (benchmarks/README.md, "Chain decoding")."""

    def __init__(self, head: RowHead, hidden: torch.Tensor):
        self.head, self.hidden = head, hidden
        self.tokens: dict[int, int] = {}

    def __getitem__(self, position: int) -> int:
        if position not in self.tokens:
            self.tokens[position] = int(self.head(self.hidden[position]).argmax(-1))
        return self.tokens[position]


class DraftCache:
    """The draft's step-0 keys and values (1, KV heads, positions, head dim) at the positions it
    has proposed from: a position's step 0 depends only on its token and its target feature."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every position's keys and values, with those of the positions after the kept ones."""
        if self.keys is not None:
            keys = torch.cat([self.keys, keys], dim=-2)
            values = torch.cat([self.values, values], dim=-2)
        self.keys, self.values = keys, values
        return keys, values


def _layer(
    draft: Eagle3Draft, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attend: Attend
) -> torch.Tensor:
    """The draft's decoder layer (``model.DraftDecoderLayer``) at ``positions`` (1, T) only:
    ``attend(q, k, v)`` gives the queries' attention, these positions' keys and values among those
    it sees. One TTT step at these positions, as ``draft.step`` computes it."""
    layer, attention, config = draft.midlayer, draft.midlayer.self_attn, draft.config
    T = tokens.shape[1]
    embeds = layer.input_layernorm(draft.embed_tokens(tokens))
    x = torch.cat([embeds, layer.hidden_norm(hidden)], dim=-1)
    q = attention.q_proj(x).view(1, T, config.num_attention_heads, config.head_dim).transpose(1, 2)
    k = attention.k_proj(x).view(1, T, config.num_key_value_heads, config.head_dim).transpose(1, 2)
    v = attention.v_proj(x).view(1, T, config.num_key_value_heads, config.head_dim).transpose(1, 2)
    cos, sin = draft.rotary(hidden, positions)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    out = attend(q, k, v).transpose(1, 2).reshape(1, T, -1)
    hidden = hidden + attention.o_proj(out)
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def _draft_token(draft: Eagle3Draft, head: RowHead, hidden: torch.Tensor) -> int:
    """The draft's token (a target id) at the last position: ``draft.logits`` with ``head``."""
    return int(draft.draft_to_target(head(draft.norm(hidden[0, -1])).argmax(-1)))


@torch.no_grad()
def propose(
    draft: Eagle3Draft,
    ids: list[int],
    features: torch.Tensor,
    k: int,
    cache: DraftCache | None = None,
    head: RowHead | None = None,
) -> list[int]:
    """K draft tokens (target ids) continuing ``ids``; ``features`` covers the positions of
    ``ids[:-1]`` that ``cache`` does not hold yet (all of them without a cache), which join it.
    ``head``: the draft's ``lm_head`` as a :class:`RowHead`, made once for every proposal.

    Step 0 runs at those positions, each attending causally to the step-0 keys at positions up to
    its own; step j runs only at the last position p, at p + j, attending to every step-0 key and
    to its own chain's keys of steps 1..j: what training-time test computes at p.
    """
    if k == 0:
        return []
    cache = DraftCache() if cache is None else cache
    head = RowHead(draft.lm_head) if head is None else head
    start, n = len(cache), len(ids) - 1
    device = features.device
    positions = torch.arange(start, n, device=device)[None]
    seen = torch.ones(n - start, n, dtype=torch.bool, device=device).tril(start)

    def causal(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        keys, values = cache.extend(key, value)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=seen, enable_gqa=True)

    tokens = torch.tensor([ids[start + 1 :]], device=device)
    hidden = _layer(draft, tokens, draft.project(features), positions, causal)[:, -1:]
    chain_keys, chain_values = [cache.keys], [cache.values]

    def chained(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        chain_keys.append(key)
        chain_values.append(value)
        keys, values = torch.cat(chain_keys, dim=-2), torch.cat(chain_values, dim=-2)
        return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)

    proposals = [_draft_token(draft, head, hidden)]
    for j in range(1, k):
        token = torch.tensor([[proposals[-1]]], device=device)
        hidden = _layer(draft, token, hidden, positions[:, -1:] + j, chained)
        proposals.append(_draft_token(draft, head, hidden))
    return proposals


def eos_ids_of(target) -> frozenset[int]:
    """The target's end-of-sequence ids, as its ``generate`` uses them: one id or a list of them
    (Llama 3, Qwen3), from the generation config, else the model config."""
    eos = target.generation_config.eos_token_id
    if eos is None:
        eos = target.config.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def _kept(drafts: list[int], argmax: Verdicts, eos_ids: Collection[int]) -> list[int]:
    """The drafts the target agrees with, then its own next token; ``argmax[i]`` is its token after
    the i-th token it verified (the last accepted one, then the drafts)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == argmax[accepted]:
        if drafts[accepted] in eos_ids:
            break
        accepted += 1
    new = drafts[:accepted] + [argmax[accepted]]
    end = next((i for i, token in enumerate(new) if token in eos_ids), None)
    return new if end is None else new[: end + 1]


class ChainDecoder:
    """Greedy generation with chain drafts, the target and the draft made ready once for every
    prompt: each prompt then costs what serving it costs (a copy of a vocabulary-wide head made per
    prompt cost a CPU 2 ms a round)."""

    def __init__(self, target, draft: Eagle3Draft):
        self.draft = draft
        self.verifier = Verifier(target, aux_layer_ids(draft.config), draft.fc.weight.device)
        self.head = RowHead(draft.lm_head)

    @torch.no_grad()
    def generate(
        self, prompt: list[int], k: int, max_new_tokens: int, eos_ids: Collection[int]
    ) -> tuple[list[int], list[int]]:
        """(new tokens, tokens yielded by each verifying forward)."""
        verified = TargetCache(self.verifier)
        argmax, features = verified.forward(prompt)
        ids = prompt + [argmax[-1]]
        generated = [ids[-1]]
        drafted = DraftCache()
        per_forward: list[int] = []
        while len(generated) < max_new_tokens and generated[-1] not in eos_ids:
            drafts = propose(self.draft, ids, features, k, cache=drafted, head=self.head)
            argmax, features = verified.forward([ids[-1], *drafts])
            new = _kept(drafts, argmax, eos_ids)[: max_new_tokens - len(generated)]
            per_forward.append(len(new))
            ids += new
            generated += new
            verified.keep(len(ids) - 1)
            # The features of the last accepted token and the drafts kept: the next proposal's new positions.
            features = features[:, : len(new)]
        return generated, per_forward


@torch.no_grad()
def greedy_generate(target, prompt: list[int], max_new_tokens: int, eos_ids: Collection[int]) -> list[int]:
    """The target's own ``generate``, greedy: what speculative decoding must equal token for token,
    and the speed it must beat."""
    tokens = torch.tensor([prompt], device=target.get_input_embeddings().weight.device)
    pad = target.generation_config.pad_token_id
    plain = GenerationConfig(
        eos_token_id=sorted(eos_ids) or None, pad_token_id=pad if pad is not None else min(eos_ids, default=0)
    )
    # Plain greedy: generate fills what it is not told from the model's own generation config, which
    # may sample or penalise repeats (the verification, like any greedy serving, does neither).
    own, target.generation_config = target.generation_config, plain
    try:
        # An explicit mask: generate would otherwise take a prompt token equal to the pad id for padding.
        out = target.generate(
            tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=max_new_tokens, do_sample=False
        )
    finally:
        target.generation_config = own
    return out[0, len(prompt) :].tolist()


def prompt_of(input_ids: Sequence[int], loss_mask: Sequence[int]) -> list[int]:
    """The tokens before the first assistant token: what the target was asked."""
    first = next(i for i, m in enumerate(loss_mask) if m)
    return [int(token) for token in input_ids[:first]]  # a list, which decoding extends


def real_acceptance(
    target, draft: Eagle3Draft, rows, k: int, max_new_tokens: int, eos_ids: Collection[int]
) -> dict:
    """Mean tokens per verifying target forward over held-out prompts."""
    decoder = ChainDecoder(target, draft) if rows else None  # no rows: train loaded no target
    yielded: list[int] = []
    for row in rows:
        prompt = prompt_of(row.input_ids, row.loss_mask)
        if len(prompt) < 2:
            continue
        _, per_forward = decoder.generate(prompt, k, max_new_tokens, eos_ids)
        yielded += per_forward
    return {
        "prompts": len(rows),
        "verify_forwards": len(yielded),
        "acceptance_length": sum(yielded) / len(yielded) if yielded else None,
    }
