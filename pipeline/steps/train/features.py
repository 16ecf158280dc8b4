"""Where the draft's inputs come from: the target's features and its next-token distribution.

``FeatureSource`` is the interface. ``OnlineTarget`` runs the target in the training process,
wherever its plan put it (one device, or layers spread over several); ``OfflineFeatures`` reads
what the offline placement's features pass wrote (``offline.py``). Both turn the target's last
hidden state into the teacher with the same ``TeacherHead``, so the three placements compute the
same thing.

Layer ids: ``hidden_states[0]`` is the embedding output and layer i's output is
``hidden_states[i + 1]``, in every placement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pipeline.steps.train.offline import FeatureShards, row_digest

LOGITS_CHUNK = 1024
"""Positions whose full-vocabulary logits are computed at once: B*T*V would not fit for long
sequences of a real target."""


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
    layer_ids: list[int]

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> TargetBatch: ...


def check_layer_ids(layer_ids: list[int], num_layers: int) -> None:
    bad = [i for i in layer_ids if not 0 <= i < num_layers - 1]
    if bad:
        raise ValueError(
            f"feature layer ids {bad} out of range: the target has {num_layers} layers "
            f"(use 0..{num_layers - 2}; the last layer's output is the logits' input)"
        )


class TeacherHead:
    """The target's lm_head restricted to the draft vocabulary: last hidden states in, the teacher out."""

    def __init__(
        self, lm_head: torch.nn.Module, d2t: torch.Tensor, t2d: torch.Tensor, chunk: int = LOGITS_CHUNK
    ):
        self.lm_head = lm_head.eval().requires_grad_(False)
        device = lm_head.weight.device
        self.kept = (d2t + torch.arange(d2t.shape[0])).to(device)
        self.t2d = t2d.to(device)
        self.chunk = chunk

    @torch.no_grad()
    def __call__(self, last: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(teacher, in_draft_vocab) on ``device`` for ``last`` (B, T, H), the final norm's output."""
        head_device = self.kept.device
        rows, width = last.shape[:2]
        flat = last.reshape(rows * width, -1)  # a chunk is positions of any row: many short rows alike
        teacher, in_vocab = [], []
        for start in range(0, flat.shape[0], self.chunk):
            logits = self.lm_head(flat[start : start + self.chunk].to(head_device)).float()
            teacher.append(logits[..., self.kept].to(device))
            in_vocab.append(self.t2d[logits.argmax(-1)].to(device))
        return torch.cat(teacher).unflatten(0, (rows, width)), torch.cat(in_vocab).unflatten(0, (rows, width))


class OnlineTarget:
    """A Hugging Face causal LM, frozen, queried batch by batch.

    Its outputs are moved to ``device`` (the draft's; default: the device of its embedding).
    """

    def __init__(
        self,
        model,
        layer_ids: list[int],
        d2t: torch.Tensor,
        t2d: torch.Tensor,
        device: torch.device | None = None,
        chunk: int = LOGITS_CHUNK,
    ):
        self.model = model.eval().requires_grad_(False)
        self.hidden_size = model.config.hidden_size
        check_layer_ids(layer_ids, model.config.num_hidden_layers)
        self.layer_ids = list(layer_ids)
        self.head = TeacherHead(model.get_output_embeddings(), d2t, t2d, chunk)
        self.device = device or model.get_input_embeddings().weight.device

    @torch.no_grad()
    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, device: torch.device):
        """(features (B, T, 3H), last hidden state (B, T, H)) on ``device``.

        With the layers on several devices each hidden state comes from its layer's device.
        """
        first = self.model.get_input_embeddings().weight.device
        out = getattr(self.model, self.model.base_model_prefix)(
            input_ids=input_ids.to(first),
            attention_mask=attention_mask.to(first),
            output_hidden_states=True,
        )
        features = torch.cat([out.hidden_states[i + 1].to(device) for i in self.layer_ids], dim=-1)
        return features, out.last_hidden_state

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> TargetBatch:
        features, last = self.hidden(input_ids, attention_mask, self.device)
        return TargetBatch(features, *self.head(last, self.device))


class OfflineFeatures:
    """The features pass's shards, read back row by row (found by their tokens) and padded into batches."""

    def __init__(self, shards: FeatureShards, head: TeacherHead, device: torch.device):
        self.shards = shards
        self.hidden_size = shards.hidden_size
        self.layer_ids = shards.layer_ids
        self.head = head
        self.device = device

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> TargetBatch:
        rows, width = input_ids.shape
        lengths = attention_mask.sum(-1).tolist()
        features = torch.zeros(rows, width, 3 * self.hidden_size, dtype=self.shards.dtype)
        last = torch.zeros(rows, width, self.hidden_size, dtype=self.shards.dtype)
        for i, n in enumerate(lengths):
            features[i, :n], last[i, :n] = self.shards.row(row_digest(input_ids[i, :n].tolist()))
        return TargetBatch(features.to(self.device), *self.head(last, self.device))
