"""The EAGLE-3 draft model: ``fc`` + one Llama decoder layer + ``norm`` + ``lm_head`` over a draft vocabulary.

Parameter names follow the EAGLE-3 checkpoints SGLang's and SpecForge's
``LlamaForCausalLMEagle3`` load (``fc``, ``midlayer.*``, ``norm``, ``lm_head``,
buffers ``d2t``/``t2d``), so ``state_dict()`` is the exported checkpoint as is.

Shapes: B batch, T positions, H hidden, K training-time-test steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from pipeline.steps.eagle3.attention import ttt_attention


def default_layer_ids(num_layers: int) -> list[int]:
    """Low, middle and high target layers, as EAGLE-3 picks them.

    Id v is the OUTPUT of target layer v (0-based): ``hidden_states[v + 1]`` in transformers.
    SGLang reads ``eagle_aux_hidden_state_layer_ids`` the same way (it captures the input of
    layer v + 1), and its own default when a draft names none, layers [2, L/2, L-3] captured
    at their input, is this list: [1, L/2 - 1, L - 4].
    """
    return [1, num_layers // 2 - 1, num_layers - 4]


# SGLang's EAGLE-3 draft (LlamaForCausalLMEagle3) builds its MLP with SiluAndMul only.
DRAFT_ACTIVATIONS = ("silu",)
# Multi-head latent attention targets (DeepSeek-V3, Kimi-K2) keep a 512-wide latent KV per
# token; copying their heads (128, 64) x 64 (qk_rope_head_dim) as plain KV heads would give
# the draft 16k or 8k cached values per token. The draft instead uses Llama-style grouped-query
# attention, the shape of the reference drafts of such targets: heads of 128, 8 KV heads (2k).
MLA_DRAFT_HEAD_DIM = 128
MLA_DRAFT_KV_HEADS = 8


def check_draftable(target) -> None:
    """What the served draft cannot run is refused before any work (``target``: its config)."""
    if target.hidden_act not in DRAFT_ACTIVATIONS:
        raise ValueError(
            f"the target's hidden_act is {target.hidden_act!r}: SGLang's EAGLE-3 draft runs only "
            f"{', '.join(DRAFT_ACTIVATIONS)}, so a draft copying it could not be served"
        )


def draft_attention(target) -> tuple[int, int, int]:
    """(heads, KV heads, head dim) of the draft for ``target``: the target's own, except for MLA."""
    if getattr(target, "kv_lora_rank", None):
        if target.hidden_size >= MLA_DRAFT_HEAD_DIM * MLA_DRAFT_KV_HEADS:
            return target.hidden_size // MLA_DRAFT_HEAD_DIM, MLA_DRAFT_KV_HEADS, MLA_DRAFT_HEAD_DIM
        # A target narrower than eight heads of 128 (a test's): one KV head per query head of its width.
        head_dim = target.hidden_size // target.num_attention_heads
        return target.num_attention_heads, target.num_attention_heads, head_dim
    head_dim = getattr(target, "head_dim", None) or target.hidden_size // target.num_attention_heads
    return target.num_attention_heads, target.num_key_value_heads, head_dim


def draft_config(target: LlamaConfig, draft_vocab_size: int, layer_ids: list[int]) -> LlamaConfig:
    """The draft's config: the target's width and vocabulary, one layer, a draft vocabulary."""
    check_draftable(target)
    heads, kv_heads, head_dim = draft_attention(target)
    rope = dict(getattr(target, "rope_parameters", None) or {})
    rope_theta = rope.get("rope_theta", getattr(target, "rope_theta", 10000.0))
    config = LlamaConfig(
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_act=target.hidden_act,
        max_position_embeddings=target.max_position_embeddings,
        rms_norm_eps=target.rms_norm_eps,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        pad_token_id=target.pad_token_id,
        eos_token_id=target.eos_token_id,
    )
    config.architectures = ["LlamaForCausalLMEagle3"]
    config.draft_vocab_size = draft_vocab_size
    config.target_hidden_size = target.hidden_size
    config.rope_theta = rope_theta
    # SGLang reads the feature layers from eagle_config, vLLM from the top level.
    config.eagle_config = {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True}
    config.eagle_aux_hidden_state_layer_ids = list(layer_ids)
    return config


def aux_layer_ids(config: LlamaConfig) -> list[int]:
    """The feature layers a draft's config states (what SGLang will capture)."""
    return list(config.eagle_config["eagle_aux_hidden_state_layer_ids"])


# ---------------------------------------------------------------- layers


@dataclass
class StepCache:
    """Keys and values of the TTT steps run so far (one entry per step), at the KV heads' width."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def empty(cls) -> StepCache:
        return cls([], [])


class DraftAttention(nn.Module):
    """Llama attention whose input is concat(embedding, feature): 2H wide."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys, values):
        """(output, this step's keys, its values): the step sees ``keys``/``values`` of the steps
        before it and its own (pure: a recomputed step gives the same three)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = ttt_attention(q, [*keys, k], [*values, v])
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), k, v


class DraftDecoderLayer(nn.Module):
    """The one decoder layer: the feature is the residual stream, the embedding joins attention."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, embeds, hidden, cos, sin, keys, values):
        """(the step's output, its keys, its values), as :meth:`DraftAttention.forward`."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attended, k, v = self.self_attn(x, cos, sin, keys, values)
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), k, v


class Eagle3Draft(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        # The target's input embedding, frozen; SGLang shares the target's at serve time.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = DraftDecoderLayer(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Step 0's input from the target's features (B, T, 3H).

        The features come in the target's dtype (bf16 on GPU) and the draft trains in fp32:
        outside autocast (evaluation) the two would not multiply.
        """
        return self.fc(features.to(self.fc.weight.dtype))

    def step(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: StepCache,
    ) -> torch.Tensor:
        """One TTT step: ``tokens`` (B, T), ``hidden`` (B, T, H) -> the step's output (B, T, H).

        Step 0 takes ``hidden = project(features)``; step k+1 takes step k's output.
        """
        out, k, v = self._step(tokens, hidden, positions, tuple(cache.keys), tuple(cache.values))
        cache.keys.append(k)
        cache.values.append(v)
        return out

    def _step(self, tokens, hidden, positions, keys: tuple, values: tuple):
        cos, sin = self.rotary(hidden, positions)
        return self.midlayer(self.embed_tokens(tokens), hidden, cos, sin, keys, values)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of a step's output."""
        return self.lm_head(self.norm(out))

    def forward(
        self, tokens: torch.Tensor, features: torch.Tensor, steps: int, recompute: bool = False
    ) -> list[torch.Tensor]:
        """All ``steps`` TTT outputs for teacher-forced tokens: step k sees ``tokens`` shifted by k.

        ``tokens[:, p]`` is the token after position p; ``features`` (B, T, 3H) the target's.
        Step k runs at positions p + k, as a chain built on p runs at inference.

        ``recompute``: keep only each step's inputs, output, keys and values for the backward and
        run the step again there (activation checkpointing): a step's layer keeps some 20 hidden
        widths a position otherwise.
        """
        B, T = tokens.shape
        keys: tuple = ()
        values: tuple = ()
        hidden = self.project(features)
        base = torch.arange(T, device=tokens.device).expand(B, T)
        outs = []
        for k in range(steps):
            args = (shift_left(tokens, k), hidden, base + k, keys, values)
            if recompute and torch.is_grad_enabled():
                hidden, key, value = checkpoint(self._step, *args, use_reentrant=False)
            else:
                hidden, key, value = self._step(*args)
            keys, values = (*keys, key), (*values, value)
            outs.append(hidden)
        return outs

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def shift_left(x: torch.Tensor, by: int, fill: int | float = 0) -> torch.Tensor:
    """``x[:, p + by]`` at position p, ``fill`` past the end."""
    if by == 0:
        return x
    pad = x.new_full((x.shape[0], min(by, x.shape[1]), *x.shape[2:]), fill)  # a row shorter than ``by``
    return torch.cat([x[:, by:], pad], dim=1)


# ---------------------------------------------------------------- vocabulary map


def vocab_map(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` keeping the ``draft_vocab_size`` most frequent tokens.

    Ties (and tokens never seen) go to the lower id, so the map is deterministic.
    ``d2t[i] = kept[i] - i`` with ``kept`` ascending; ``t2d`` marks kept target ids.
    """
    vocab = counts.shape[0]
    size = min(draft_vocab_size, vocab)
    # A stable sort by descending count keeps id order among equal counts.
    order = torch.sort(-counts.to(torch.float64), stable=True).indices
    kept = torch.sort(order[:size]).values
    d2t = kept - torch.arange(size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d


# ---------------------------------------------------------------- loss


def soft_cross_entropy(
    logits: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masked ``-sum(p_teacher * log q)``: (loss sum, correct argmax count, position count)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    target = torch.softmax(teacher.float(), dim=-1)
    per_pos = -(target * logp).sum(-1)
    maskf = mask.to(per_pos.dtype)
    correct = ((logits.argmax(-1) == teacher.argmax(-1)) & mask).sum()
    return (per_pos * maskf).sum(), correct, mask.sum()
