"""The TTT attention in memory linear in T against the T×T one it replaced: the same outputs and
gradients, for several row lengths, step counts and grouped-query shapes, with every kernel that
runs here; and nothing of T×T size kept for the backward."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig

from pipeline.steps.eagle3.attention import BLOCKED, CPU_FLASH, ttt_attention
from pipeline.steps.eagle3.model import Eagle3Draft, draft_config, shift_left, soft_cross_entropy
from pipeline.steps.train.features import TargetBatch
from pipeline.steps.train.loop import DraftLoss


def quadratic_ttt_attention(q, keys, values):
    """The implementation this replaced: each head's T×T scores plus one column per later step,
    one softmax (KV heads repeated for their query heads)."""
    group = q.shape[1] // keys[0].shape[1]
    keys = [k.repeat_interleave(group, dim=1) for k in keys]
    values = [v.repeat_interleave(group, dim=1) for v in values]
    T = q.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    scores = [(q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
    scores += [(q * k).sum(-1, keepdim=True) * scale for k in keys[1:]]
    probs = torch.softmax(
        torch.cat(scores, dim=-1), dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)
    )
    probs = probs.to(q.dtype)
    out = probs[..., :T] @ values[0]
    for j, v in enumerate(values[1:], start=1):
        out = out + probs[..., T + j - 1 : T + j] * v
    return out


def attention_inputs(batch, heads, kv_heads, length, dim, steps, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def tensor(h):
        return torch.randn(batch, h, length, dim, dtype=dtype, generator=generator).requires_grad_()

    return tensor(heads), [tensor(kv_heads) for _ in range(steps)], [tensor(kv_heads) for _ in range(steps)]


def outputs_and_gradients(attention, q, keys, values, upstream):
    out = attention(q, keys, values)
    grads = torch.autograd.grad((out.float() * upstream).sum(), [q, *keys, *values])
    return out, grads


# (batch, heads, KV heads, T, head dim, K): plain and grouped-query heads, rows shorter and longer
# than a kernel's block, one step and the trainer's seven.
SHAPES = [(2, 4, 4, 7, 8, 1), (2, 8, 2, 37, 16, 3), (1, 4, 1, 300, 16, 7), (1, 6, 3, 600, 32, 2)]


@pytest.mark.parametrize("kernel", [CPU_FLASH, BLOCKED], ids=lambda k: k.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}h{}kv{}T{}d{}K{}".format(*s))
def test_outputs_and_gradients_equal_the_quadratic_attention_in_fp64(kernel, shape):
    """Tolerance 1e-10 in fp64: the same function, computed in another order."""
    q, keys, values = attention_inputs(*shape, torch.float64)
    upstream = torch.randn(q.shape, dtype=torch.float64)
    out, grads = outputs_and_gradients(lambda *a: ttt_attention(*a, kernel=kernel), q, keys, values, upstream)
    ref_out, ref_grads = outputs_and_gradients(quadratic_ttt_attention, q, keys, values, upstream)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    for grad, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kernel", [CPU_FLASH, BLOCKED], ids=lambda k: k.name)
def test_bf16_stays_within_bf16_rounding_of_the_fp32_result(kernel):
    """Under bf16 (the GPU's precision) both implementations round; the new one stays as near the
    fp32 result as the old one: within 2x the old error plus one bf16 ulp at the outputs' scale."""
    shape = (2, 8, 2, 200, 32, 4)
    q, keys, values = attention_inputs(*shape, torch.float32)
    upstream = torch.randn(q.shape)
    exact, exact_grads = outputs_and_gradients(quadratic_ttt_attention, q, keys, values, upstream)
    low = [x.detach().bfloat16().requires_grad_() for x in (q, *keys, *values)]
    lq, lkeys, lvalues = low[0], low[1 : 1 + len(keys)], low[1 + len(keys) :]
    new, new_grads = outputs_and_gradients(
        lambda *a: ttt_attention(*a, kernel=kernel), lq, lkeys, lvalues, upstream
    )
    old, old_grads = outputs_and_gradients(quadratic_ttt_attention, lq, lkeys, lvalues, upstream)
    for ours, theirs, truth in [(new, old, exact), *zip(new_grads, old_grads, exact_grads, strict=True)]:
        ulp = 2**-8 * truth.abs().max()
        assert (ours.float() - truth).abs().max() <= 2 * (theirs.float() - truth).abs().max() + ulp


def saved_storages(forward) -> list[int]:
    """Sizes of the storages autograd saves for the backward while ``forward`` runs."""
    sizes: dict[int, int] = {}

    def keep(tensor):
        sizes[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        forward()
    return list(sizes.values())


def test_nothing_of_t_by_t_size_is_kept_for_the_backward():
    """At T = 1024 one head's score rows would be 4 MiB; the largest tensor kept is a (B, h, T, d)
    one, and the old attention kept several of T x T."""
    q, keys, values = attention_inputs(1, 4, 2, 1024, 16, 3, torch.float32)
    largest = q.numel() * q.element_size()
    assert max(saved_storages(lambda: ttt_attention(q, keys, values))) <= largest
    assert max(saved_storages(lambda: quadratic_ttt_attention(q, keys, values))) >= 1024 * 1024 * 4


def small_draft() -> Eagle3Draft:
    target = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    return Eagle3Draft(draft_config(target, 128, [1, 3, 4])).double()


def training_inputs(batch=2, length=50):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (batch, length), generator=generator)
    mask = torch.rand(batch, length, generator=generator) > 0.3
    target = TargetBatch(
        torch.randn(batch, length, 3 * 64, generator=generator, dtype=torch.float64),
        torch.randn(batch, length, 128, generator=generator, dtype=torch.float64),
        torch.rand(batch, length, generator=generator) > 0.1,
    )
    return ids, mask, target


def shifted_copies_loss(draft, steps, decay, ids, mask, target):
    """The loss as it was written before: every step's teacher a shifted copy of the whole teacher."""
    outs = draft(shift_left(ids, 1), target.features, steps)
    total = torch.zeros((), dtype=torch.float64)
    for k, out in enumerate(outs):
        teacher = shift_left(target.teacher, k + 1)
        step_mask = shift_left(mask, k + 2, False) & shift_left(target.in_draft_vocab, k + 1, False)
        loss_sum, _, count = soft_cross_entropy(draft.logits(out), teacher, step_mask)
        total = total + decay**k * loss_sum / count.clamp(min=1)
    return total


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_the_draft_loss_and_its_gradients_are_those_of_the_loss_before(recompute):
    """Views of the teacher instead of shifted copies, loss chunks, and each TTT step recomputed in
    the backward or kept: the same loss and the same gradients."""
    draft, (ids, mask, target) = small_draft(), training_inputs()
    params = [p for p in draft.parameters() if p.requires_grad]
    loss, _ = DraftLoss(draft, 4, 0.8, 16, recompute)(ids, mask, target)
    grads = torch.autograd.grad(loss, params)
    ref = shifted_copies_loss(draft, 4, 0.8, ids, mask, target)
    ref_grads = torch.autograd.grad(ref, params)
    # The total starts as an fp32 zero, as in training; the fp64 sums agree to fp32's precision.
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=0)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)


def test_rows_shorter_than_the_steps_train_on_what_they_have():
    draft, (ids, mask, target) = small_draft(), training_inputs(length=3)
    loss, stats = DraftLoss(draft, 5, 0.8, 16, True)(ids, mask, target)
    assert torch.isfinite(loss) and [int(count) for _, _, count in stats][2:] == [0, 0, 0]
