"""Training-time-test attention in memory linear in the row: no T×T tensor is kept for the backward.

At TTT step k a query at position p sees the step-0 keys at positions <= p (causal) and, of steps
1..k, only the key at its own position p (the chain of drafts built on p). The causal part is one
fused attention that returns its log-sum-exp (``lse``); the k extra keys are one score each per
position, so the two merge in closed form::

    lse = logsumexp(lse_0, s_1, ..., s_k)        s_j = q · k_j[p] · scale
    out = exp(lse_0 - lse) · out_0 + Σ_j exp(s_j - lse) · v_j[p]

The backward hands the fused kernel the merged ``out`` and ``lse``: its probabilities
``exp(S - lse)`` are then the merged softmax's, and the row term it subtracts, ``rowsum(dout ·
out)``, is the merged one, so its dq, dk, dv are exact (the trick ring attention uses to merge
blocks). What is kept: q, the step-0 keys and values, out, lse: linear in T.

Kernels: PyTorch's CPU flash attention on a CPU; flash-attn's on a GPU in half precision (the
pipeline image bakes it in); elsewhere a blocked attention over query chunks in plain PyTorch
(transient memory one chunk × T, nothing of it kept).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Query positions per chunk of the blocked kernel: its transient scores are chunk × T per head.
QUERY_CHUNK = 256


@dataclass(frozen=True)
class Kernel:
    """A causal attention over (B, h, T, d) queries and (B, h_kv, T, d) keys that returns (out, lse),
    and its backward from the merged (out, lse)."""

    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _cpu_forward(q, k, v, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)


def _cpu_backward(dout, q, k, v, out, lse, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, True, scale=scale
    )


def _seq_major(x: torch.Tensor) -> torch.Tensor:
    """(B, h, T, d) <-> (B, T, h, d), flash-attn's layout."""
    return x.transpose(1, 2)


def _flash_forward(q, k, v, scale):
    out, lse, _, _ = torch.ops.flash_attn._flash_attn_forward(
        *map(_seq_major, (q, k, v)), 0.0, scale, True, -1, -1, 0.0, None, False
    )
    return _seq_major(out), lse


def _flash_backward(dout, q, k, v, out, lse, scale):
    q, k, v = (_seq_major(x).contiguous() for x in (q, k, v))
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    torch.ops.flash_attn._flash_attn_backward(
        _seq_major(dout),
        q,
        k,
        v,
        _seq_major(out),
        lse,
        dq,
        dk,
        dv,
        0.0,
        scale,
        True,
        -1,
        -1,
        0.0,
        None,
        False,
        None,
    )
    return _seq_major(dq), _seq_major(dk), _seq_major(dv)


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """KV heads repeated for their query heads (head i reads KV head i // group)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1) if x.shape[1] != heads else x


def _accumulate(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least fp32 (bf16 scores lose the small probabilities)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _chunk_scores(q, k, start: int, scale: float) -> torch.Tensor:
    """Causal scores of the queries ``start:start + len`` against the keys they may see."""
    end = start + q.shape[-2]
    scores = (_accumulate(q) @ _accumulate(k[..., :end, :]).transpose(-1, -2)) * scale
    allowed = torch.arange(end, device=q.device)[None] <= torch.arange(start, end, device=q.device)[:, None]
    return scores.masked_fill(~allowed, float("-inf"))


def _blocked_forward(q, k, v, scale):
    k, v = _expand_heads(k, q.shape[1]), _expand_heads(v, q.shape[1])
    outs, lses = [], []
    for start in range(0, q.shape[-2], QUERY_CHUNK):
        scores = _chunk_scores(q[..., start : start + QUERY_CHUNK, :], k, start, scale)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse[..., None])
        outs.append((probs @ _accumulate(v[..., : scores.shape[-1], :])).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def _blocked_backward(dout, q, k, v, out, lse, scale):
    heads, kv_heads = q.shape[1], k.shape[1]
    ke, ve = _accumulate(_expand_heads(k, heads)), _accumulate(_expand_heads(v, heads))
    dq = torch.empty_like(ke[..., : q.shape[-2], :])
    dk, dv = torch.zeros_like(ke), torch.zeros_like(ve)
    rows = (_accumulate(dout) * _accumulate(out)).sum(-1)
    for start in range(0, q.shape[-2], QUERY_CHUNK):
        part = slice(start, start + QUERY_CHUNK)
        qc, doc = _accumulate(q[..., part, :]), _accumulate(dout[..., part, :])
        probs = torch.exp(_chunk_scores(qc, ke, start, scale) - lse[..., part, None])
        end = probs.shape[-1]
        dv[..., :end, :] += probs.transpose(-1, -2) @ doc
        dscores = probs * (doc @ ve[..., :end, :].transpose(-1, -2) - rows[..., part, None]) * scale
        dq[..., part, :] = dscores @ ke[..., :end, :]
        dk[..., :end, :] += dscores.transpose(-1, -2) @ qc
    if kv_heads != heads:  # each KV head's gradient is the sum over the query heads that read it
        dk = dk.unflatten(1, (kv_heads, heads // kv_heads)).sum(2)
        dv = dv.unflatten(1, (kv_heads, heads // kv_heads)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


CPU_FLASH = Kernel("cpu-flash", _cpu_forward, _cpu_backward)
FLASH_ATTN = Kernel("flash-attn", _flash_forward, _flash_backward)
BLOCKED = Kernel("blocked", _blocked_forward, _blocked_backward)


def kernel_for(q: torch.Tensor) -> Kernel:
    """The fused kernel for these queries: CPU flash on a CPU, flash-attn on a GPU in half precision
    when it is installed, the blocked one otherwise."""
    if q.device.type == "cpu":
        return CPU_FLASH
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        try:
            import flash_attn  # noqa: F401  (registers torch.ops.flash_attn)
        except ImportError:
            return BLOCKED
        return FLASH_ATTN
    return BLOCKED


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, h, T, ...) as (B, h_kv, group, T, ...): query heads beside the KV head they read."""
    return x.unflatten(1, (kv_heads, x.shape[1] // kv_heads))


class _TTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernel: Kernel, scale: float, q, k0, v0, *chain):
        keys, values = chain[0::2], chain[1::2]
        kv = k0.shape[1]
        out0, lse0 = kernel.forward(q, k0, v0, scale)
        qg = _accumulate(_grouped(q, kv))
        # (B, h_kv, group, T): step j's own-position score, in at least fp32.
        scores = [(qg * _accumulate(key[:, :, None])).sum(-1) * scale for key in keys]
        lse = torch.logsumexp(torch.stack([_accumulate(_grouped(lse0, kv)), *scores], dim=-1), dim=-1)
        out = _accumulate(_grouped(out0, kv)) * torch.exp(_grouped(lse0, kv) - lse)[..., None]
        weights = [torch.exp(s - lse) for s in scores]
        for w, value in zip(weights, values, strict=True):
            out = out + w[..., None] * _accumulate(value[:, :, None])
        out, lse = out.flatten(1, 2).to(q.dtype).contiguous(), lse.flatten(1, 2).to(lse0.dtype).contiguous()
        ctx.kernel, ctx.scale, ctx.steps = kernel, scale, len(keys)
        ctx.save_for_backward(q, k0, v0, out, lse, *chain, *weights)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k0, v0, out, lse, *rest = ctx.saved_tensors
        chain, weights = rest[: 2 * ctx.steps], rest[2 * ctx.steps :]
        dout = dout.contiguous()
        dq, dk0, dv0 = ctx.kernel.backward(dout, q, k0, v0, out, lse, ctx.scale)
        if not weights:
            return None, None, dq, dk0, dv0
        kv = k0.shape[1]
        accumulate = weights[0].dtype
        qg, dog = _grouped(q, kv).to(accumulate), _grouped(dout, kv).to(accumulate)
        rows = (dog * _grouped(out, kv).to(accumulate)).sum(-1)
        dqg = _grouped(dq, kv).to(accumulate)
        grads = []
        for j, w in enumerate(weights):
            key, value = chain[2 * j][:, :, None].to(accumulate), chain[2 * j + 1][:, :, None].to(accumulate)
            dscore = w * ((dog * value).sum(-1) - rows) * ctx.scale
            dqg = dqg + dscore[..., None] * key
            grads.append((dscore[..., None] * qg).sum(2).to(q.dtype))  # the key's
            grads.append((w[..., None] * dog).sum(2).to(q.dtype))  # the value's
        return None, None, dqg.flatten(1, 2).to(q.dtype), dk0, dv0, *grads


def ttt_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], kernel: Kernel | None = None
) -> torch.Tensor:
    """Attention of training-time-test step k = len(keys) - 1.

    ``q``: (B, h, T, d); ``keys[j]``/``values[j]``: (B, h_kv, T, d), step j's keys and values, h a
    multiple of h_kv (grouped-query attention). A query at position p sees the step-0 keys at
    positions <= p (causal) and, of steps 1..k, only the key at its own position p.
    """
    chain = [x for pair in zip(keys[1:], values[1:], strict=True) for x in pair]
    scale = 1.0 / math.sqrt(q.shape[-1])
    return _TTTAttention.apply(kernel or kernel_for(q), scale, q, keys[0], values[0], *chain)
