"""Where the draft's inputs come from: the target's features and its next-token distribution.

``FeatureSource`` is the interface; ``OnlineTarget`` runs the target in the training
process. An offline source (features precomputed to disk, e.g. dumped by a server)
implements the same call and plugs in unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class TargetBatch:
    features: torch.Tensor
    """(B, T, 3H): the chosen layers' outputs at each position, concatenated."""
    teacher: torch.Tensor
    """(B, T, V'): the target's logits at each position, restricted to the draft vocabulary."""
    in_draft_vocab: torch.Tensor
    """(B, T) bool: the target's argmax at each position is in the draft vocabulary."""


class FeatureSource(Protocol):
    hidden_size: int
    num_layers: int

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> TargetBatch: ...


class OnlineTarget:
    """A Hugging Face causal LM, frozen, queried batch by batch."""

    def __init__(self, model, layer_ids: list[int], d2t: torch.Tensor, t2d: torch.Tensor, chunk: int = 1024):
        self.model = model.eval().requires_grad_(False)
        self.hidden_size = model.config.hidden_size
        self.num_layers = model.config.num_hidden_layers
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers - 1]
        if bad:
            raise ValueError(
                f"feature layer ids {bad} out of range: the target has {self.num_layers} layers "
                f"(use 0..{self.num_layers - 2}; the last layer's output is the logits' input)"
            )
        self.layer_ids = list(layer_ids)
        self.kept = d2t + torch.arange(d2t.shape[0])
        self.t2d = t2d
        self.chunk = chunk

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> TargetBatch:
        device = next(self.model.parameters()).device
        out = self.model.model(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            output_hidden_states=True,
        )
        # hidden_states[0] is the embedding output; layer i's output is hidden_states[i + 1].
        features = torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)
        last = out.last_hidden_state
        head = self.model.get_output_embeddings()
        kept, t2d = self.kept.to(device), self.t2d.to(device)
        teacher, in_vocab = [], []
        # Full-vocabulary logits only a chunk of positions at a time: B*T*V would not fit for long
        # sequences of a real target.
        for start in range(0, last.shape[1], self.chunk):
            logits = head(last[:, start : start + self.chunk]).float()
            teacher.append(logits[..., kept])
            in_vocab.append(t2d[logits.argmax(-1)])
        return TargetBatch(features, torch.cat(teacher, dim=1), torch.cat(in_vocab, dim=1))
