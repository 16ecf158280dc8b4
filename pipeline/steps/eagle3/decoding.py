"""A real speculative-decoding loop: the draft proposes a chain of K tokens, the target verifies greedily.

The output is exactly the target's greedy output (verification keeps only tokens the
target would have chosen, plus the target's own next token), so the loop is lossless;
what it measures is how many tokens each target forward yields: the acceptance length.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from pipeline.steps.eagle3.model import Eagle3Draft, StepCache, aux_layer_ids


@torch.no_grad()
def _target_pass(target, ids: list[int], layer_ids: list[int], device: torch.device):
    """The target's greedy tokens after each of ``ids`` and its features, on ``device`` (the draft's)."""
    first = target.get_input_embeddings().weight.device
    out = target(input_ids=torch.tensor([ids], device=first), output_hidden_states=True)
    features = torch.cat([out.hidden_states[i + 1].to(device) for i in layer_ids], dim=-1)
    return out.logits[0].argmax(-1).tolist(), features


@torch.no_grad()
def propose(draft: Eagle3Draft, ids: list[int], features: torch.Tensor, k: int) -> list[int]:
    """K draft tokens (target ids) continuing ``ids``; ``features`` covers ``ids[:-1]``.

    Step 0 runs over every position with its real target feature; step j runs the chain
    built on the last position, whose key/value pairs are the only step-j ones it sees,
    exactly as in training-time test.
    """
    n = len(ids) - 1
    device = features.device
    tokens = torch.tensor([ids[1:]], device=device)
    positions = torch.arange(n, device=device)[None]
    cache = StepCache.empty()
    hidden = draft.project(features[:, :n])
    proposals: list[int] = []
    for j in range(k):
        hidden = draft.step(tokens, hidden, positions + j, cache)
        token = int(draft.draft_to_target(draft.logits(hidden[:, -1]).argmax(-1)))
        proposals.append(token)
        tokens = tokens.clone()
        tokens[0, -1] = token
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


@torch.no_grad()
def speculative_generate(
    target, draft: Eagle3Draft, prompt: list[int], k: int, max_new_tokens: int, eos_ids: Collection[int]
) -> tuple[list[int], list[int]]:
    """Greedy generation with chain drafts: (new tokens, tokens yielded by each verifying forward)."""
    layer_ids = aux_layer_ids(draft.config)
    device = draft.fc.weight.device
    argmax, features = _target_pass(target, prompt, layer_ids, device)
    ids = prompt + [argmax[-1]]
    generated = [argmax[-1]]
    per_forward: list[int] = []
    while len(generated) < max_new_tokens and generated[-1] not in eos_ids:
        drafts = propose(draft, ids, features, k)
        argmax, features = _target_pass(target, ids + drafts, layer_ids, device)
        base = len(ids) - 1  # the target's prediction after ids[-1]
        accepted = 0
        while accepted < k and drafts[accepted] == argmax[base + accepted]:
            if drafts[accepted] in eos_ids:
                break
            accepted += 1
        new = drafts[:accepted] + [argmax[base + accepted]]
        end = next((i for i, token in enumerate(new) if token in eos_ids), None)
        if end is not None:
            new = new[: end + 1]
        new = new[: max_new_tokens - len(generated)]
        per_forward.append(len(new))
        ids += new
        generated += new
    return generated, per_forward


def prompt_of(input_ids: Sequence[int], loss_mask: Sequence[int]) -> list[int]:
    """The tokens before the first assistant token: what the target was asked."""
    first = next(i for i, m in enumerate(loss_mask) if m)
    return [int(token) for token in input_ids[:first]]  # a list, which decoding extends


def real_acceptance(
    target, draft: Eagle3Draft, rows, k: int, max_new_tokens: int, eos_ids: Collection[int]
) -> dict:
    """Mean tokens per verifying target forward over held-out prompts."""
    yielded: list[int] = []
    for row in rows:
        prompt = prompt_of(row.input_ids, row.loss_mask)
        if len(prompt) < 2:
            continue
        _, per_forward = speculative_generate(target, draft, prompt, k, max_new_tokens, eos_ids)
        yielded += per_forward
    return {
        "prompts": len(rows),
        "verify_forwards": len(yielded),
        "acceptance_length": sum(yielded) / len(yielded) if yielded else None,
    }
