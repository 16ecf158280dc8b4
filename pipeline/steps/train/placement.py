"""Where the frozen target lives while the draft trains: a plan a person can read and check.

- ``replicated``: the whole target on this process's device next to the draft (one copy per rank
  under DDP).
- ``sharded``: the target split layer by layer across every GPU of the host, in one process; the
  draft trains on the first GPU, beside the target's first layers.
- ``offline``: the target runs once, before training, and writes its features to disk
  (``offline.py``); training then holds the draft and the target's lm_head only.
- ``auto``: replicated when the target fits one device next to the draft, sharded otherwise.

A plan is arithmetic over three kinds of figures: the size of each module of the target, computed
by transformers for the model built on the meta device (nothing is read or allocated); what the
draft needs (weights, gradients, AdamW state, activations: :func:`draft_bytes`); and each device's
free memory (``torch.cuda.mem_get_info``; without GPUs, the memory this process really has). It is
printed, recorded in the manifest, and its device map goes to ``from_pretrained(device_map=...)``
as is, so what is loaded is what was planned.

Weights are counted as they are held (the target's format: ``pipeline/steps/target/format.py``):
dense ones at the load dtype; a quantized target's packed weights as stored, with the scales
(``pipeline/steps/target/quantized.py``), plus, on each device, the largest dense weight one of
them makes while its forward runs (one expert's). A vision-language wrapper's language model is
planned; its vision tower is never loaded, and its bytes are stated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from pipeline.memory.units import format_size
from pipeline.steps.target.format import target_format
from pipeline.steps.target.holding import Holding
from pipeline.steps.target.meta import MetaTarget, meta_target

Placement = Literal["auto", "replicated", "sharded", "offline"]
# Left unplanned on every device: the allocator's fragmentation, library workspaces, and the
# transient tensors inside one layer's forward.
HEADROOM = 0.05
# Bytes per saved element in the draft's activation estimate: fp32 (under bf16 autocast most saved
# tensors are half that).
_ACT_BYTES = 4
# A TTT step's token and position ids (int64) and its loss mask, per position, with the
# allocator's rounding.
_STEP_INDEX_BYTES = 40
_LAYER = re.compile(r"\.layers\.(\d+)$")


class PlacementError(ValueError):
    """The target cannot be placed as asked; the message gives the numbers."""


@dataclass(frozen=True)
class Device:
    name: str
    """A torch device: ``cuda:3``, ``cpu``."""
    free: int
    """Bytes free when measured."""

    @property
    def usable(self) -> int:
        return int(self.free * (1 - HEADROOM))


@dataclass(frozen=True)
class Unit:
    """One module the device map places whole: the embedding, a decoder layer, the final norm, the lm_head."""

    module: str
    weights: int
    activations: int
    """What its output holds on its device during the target's forward (the hidden states kept for
    the features, the teacher logits on the lm_head's device)."""
    packed: int = 0
    """Of ``weights``, the bytes held packed (quantized weights as stored, and their scales)."""
    transient: int = 0
    """The largest dense weight a packed module of it makes for its forward (one expert's)."""


class TargetUnits(list):
    """A target's units in forward order, with what the target holds beside them."""

    left_out: int = 0
    """Bytes of the wrapper's modules that are never loaded (a vision tower and its projector)."""
    holding: Holding = Holding.DENSE
    """How its weights are held (its format's)."""


@dataclass
class Share:
    """One device's part of a plan."""

    device: Device
    modules: list[str] = field(default_factory=list)
    weights: int = 0
    activations: int = 0
    draft: int = 0
    packed: int = 0
    transient: int = 0

    @property
    def planned(self) -> int:
        return self.weights + self.activations + self.draft + self.transient

    def take(self, unit: Unit) -> None:
        self.modules.append(unit.module)
        self.weights += unit.weights
        self.activations += unit.activations
        self.packed += unit.packed
        self.transient = max(self.transient, unit.transient)

    @property
    def layers(self) -> list[int]:
        return [int(m.group(1)) for m in map(_LAYER.search, self.modules) if m]


@dataclass
class Plan:
    placement: str
    """``replicated``, ``sharded`` or ``offline``: what ``auto`` resolved to."""
    reason: str
    shares: list[Share]
    features: Plan | None = None
    """For ``offline``: where the target runs during its one pass over the data."""
    left_out: int = 0
    """Bytes of the target's modules never loaded (a wrapper's vision tower)."""
    holding: Holding = Holding.DENSE

    @property
    def draft_device(self) -> str:
        return self.shares[0].device.name

    def device_map(self) -> dict[str, str]:
        return {module: share.device.name for share in self.shares for module in share.modules}

    def describe(self) -> list[str]:
        lines = [f"target placement: {self.placement} ({self.reason})"]
        for i, share in enumerate(self.shares):
            parts = [_describe_layers(share.layers)] if share.layers else []
            parts += [m.rsplit(".", 1)[-1] for m in share.modules if not _LAYER.search(m)]
            parts += ["the draft"] if share.draft else []
            held = ", ".join(parts)
            packed = (
                f" ({format_size(share.packed)} packed, {format_size(share.weights - share.packed)} dense; "
                f"largest expert dequantized {format_size(share.transient)})"
                if share.packed
                else ""
            )
            lines.append(
                f"  device {i} ({share.device.name}): {held}; planned {format_size(share.planned)} "
                f"(weights {format_size(share.weights)}{packed}, "
                f"activations {format_size(share.activations)}, draft {format_size(share.draft)}) "
                f"of {format_size(share.device.free)} free"
            )
        if self.left_out:
            lines.append(f"  not loaded: the vision tower and its projector ({format_size(self.left_out)})")
        if self.features is not None:
            lines += ["features pass: " + line.strip() for line in self.features.describe()[1:]]
        return lines

    def as_dict(self) -> dict:
        out = {
            "placement": self.placement,
            "reason": self.reason,
            "headroom_fraction": HEADROOM,
            "target_holding": str(self.holding),
            "left_out_bytes": self.left_out,
            "devices": [
                {
                    "device": share.device.name,
                    "free_bytes": share.device.free,
                    "planned_bytes": share.planned,
                    "weight_bytes": share.weights,
                    "packed_bytes": share.packed,
                    "dense_bytes": share.weights - share.packed,
                    "transient_bytes": share.transient,
                    "activation_bytes": share.activations,
                    "draft_bytes": share.draft,
                    "layers": share.layers,
                    "modules": share.modules,
                }
                for share in self.shares
            ],
        }
        if self.features is not None:
            out["features_pass"] = self.features.as_dict()
        return out


def _describe_layers(layers: list[int]) -> str:
    if len(layers) == 1:
        return f"layer {layers[0]}"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"layers {layers[0]}-{layers[-1]}"
    return "layers " + ",".join(map(str, layers))


# ---------------------------------------------------------------- sizes


def target_units(
    config,
    dtype,
    batch_size: int,
    length: int,
    draft_vocab: int,
    logits_chunk: int,
    trust_remote_code: bool = False,
    device_type: str = "cpu",
    dequantize: bool = False,
    capability: tuple[int, int] | None = None,
) -> TargetUnits:
    """:func:`units_of` the target whose checkpoint config is ``config``, its format decided for
    ``device_type`` of compute ``capability`` (default: this process's GPU's): quantized weights held
    as stored unless ``dequantize``; one that cannot be held as stored there raises ``HeldFormatError``."""
    fmt = target_format(config, device_type=device_type, capability=capability, dequantize=dequantize)
    target = meta_target(fmt, dtype, trust_remote_code=trust_remote_code)
    return units_of(target, dtype, batch_size, length, draft_vocab, logits_chunk)


def units_of(
    target: MetaTarget, dtype, batch_size: int, length: int, draft_vocab: int, logits_chunk: int
) -> TargetUnits:
    """The target's modules in forward order with their bytes as held, from its language model on the
    meta device (held as its format says).

    A batch of ``batch_size`` rows of ``length`` tokens sizes the hidden states each module's output
    keeps; ``logits_chunk`` positions of full-vocabulary logits, and the teacher over the draft
    vocabulary, sit on the lm_head's device.
    """
    import torch
    from transformers.integrations.accelerate import compute_module_sizes

    from pipeline.steps.target.quantized import largest_transient, packed_bytes, stored_weights

    model, fmt = target.model, target.format
    sizes, _ = compute_module_sizes(model)
    element = torch.finfo(dtype).bits // 8
    batch_tokens = batch_size * length
    hidden = batch_tokens * fmt.text.hidden_size * element  # one kept hidden state

    def unit(name: str, child: torch.nn.Module, keeps: int) -> Unit:
        weights = sizes.get(name, 0)
        if fmt.holding is Holding.STORED:  # quantized weights at the bytes the format holds them in
            quantized = stored_weights(child, fmt.prefix + name, fmt.ignore)
            weights -= int(quantized * (element - fmt.bytes_per_weight))
        return Unit(name, weights, keeps, packed_bytes(child), largest_transient(child, dtype))

    base = model.base_model_prefix
    units = TargetUnits()
    units.left_out, units.holding = target.left_out, fmt.holding
    for name, child in getattr(model, base).named_children():
        module = f"{base}.{name}"
        if isinstance(child, torch.nn.ModuleList):
            units += [unit(f"{module}.{i}", layer, hidden) for i, layer in enumerate(child)]
        else:
            units.append(unit(module, child, hidden if name in ("embed_tokens", "norm") else 0))
    logits = min(logits_chunk, batch_tokens) * fmt.text.vocab_size * (element + 4)
    logits += batch_tokens * draft_vocab * 4
    heads = [Unit(name, sizes.get(name, 0), logits) for name, _ in model.named_children() if name != base]
    if model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        # A tied lm_head shares the embedding's weight: it goes where the embedding goes.
        units[1:1] = heads
    else:
        units += heads
    return units


def draft_activations(
    config, batch_tokens: int, length: int, ttt_steps: int, loss_chunk: int, recompute: bool
) -> tuple[int, int]:
    """(kept, transient): the bytes autograd keeps for the draft's backward, and what the step being
    computed holds besides, for a batch of ``batch_tokens`` positions in rows of ``length``. Both
    are linear in the row: the TTT attention keeps no T x T tensor (``eagle3/attention.py``).

    Kept, per position and TTT step, counted fp32 (an upper bound under bf16 autocast; checked
    against what the allocator holds after the forward in ``tests/unit/train/test_placement.py``):
    with ``recompute``, the step's output, keys and values; without it, the
    layer's own activations too, some 9 hidden widths, 4 intermediate widths and 4 query widths.
    Transient: a recomputed step's activations, the attention kernel's blocks and one loss chunk's
    logits.
    """
    from pipeline.steps.eagle3.attention import QUERY_CHUNK  # torch: this module stays light

    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    hidden = config.hidden_size
    layer = 9 * hidden + 4 * config.intermediate_size + 4 * heads * head_dim + 2 * heads
    carried = hidden + 2 * kv_heads * head_dim  # the step's output, keys and values
    step_bytes = (carried + (0 if recompute else layer)) * _ACT_BYTES + _STEP_INDEX_BYTES
    kept = ttt_steps * batch_tokens * step_bytes
    # A batch's rows together span at most batch_tokens: one chunk of queries against each row's keys.
    attention = 3 * heads * min(QUERY_CHUNK, length) * batch_tokens * _ACT_BYTES
    loss = 3 * min(loss_chunk, batch_tokens) * config.draft_vocab_size * _ACT_BYTES
    recomputed = batch_tokens * layer * _ACT_BYTES if recompute else 0
    return kept, recomputed + attention + loss


def draft_bytes(
    draft,
    batch_tokens: int,
    length: int,
    ttt_steps: int,
    loss_chunk: int,
    feature_bytes: int,
    recompute: bool,
) -> int:
    """What training the draft holds on its device, for ``draft`` built on any device (meta is enough).

    Trainable weights with their gradients, AdamW's two moments and autocast's bf16 copy; the
    frozen embedding and buffers as they are; the batch's target inputs (features and teacher);
    and the activations (:func:`draft_activations`).
    """
    config = draft.config
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in draft.parameters() if not p.requires_grad)
    buffers = sum(b.numel() * b.element_size() for b in draft.buffers())
    inputs = batch_tokens * (3 * config.target_hidden_size * feature_bytes + config.draft_vocab_size * 4 + 1)
    activations = sum(draft_activations(config, batch_tokens, length, ttt_steps, loss_chunk, recompute))
    # fp32 weights, gradients and AdamW's two moments (16 bytes a parameter), autocast's bf16 copy (2).
    return 18 * trainable + frozen + buffers + inputs + activations


# ---------------------------------------------------------------- planning


def split(units: list[Unit], devices: list[Device], draft: int) -> list[Share] | None:
    """Assign the units, in order, to the devices, the draft on the first; None if they do not fit.

    First even out what the devices hold: each takes the units that bring it nearest its fair share
    of what is left, so every device keeps room for transient tensors. If that leaves units over,
    fill each device to its usable memory in turn.
    """
    for even in (True, False):
        shares = [Share(d) for d in devices]
        shares[0].draft = draft
        left = sum(u.weights + u.activations for u in units) + draft
        pending = iter(units)
        unit = next(pending, None)
        for i, share in enumerate(shares):
            fair = left / (len(shares) - i)
            while unit is not None:
                need = unit.weights + unit.activations + max(0, unit.transient - share.transient)
                if share.planned + need > share.device.usable or (even and share.planned + need / 2 > fair):
                    break
                share.take(unit)
                unit = next(pending, None)
            left -= share.planned
        if unit is None and shares[0].planned <= shares[0].device.usable:
            return [s for s in shares if s.modules or s.draft]
    return None


def plan(
    placement: str,
    units: list[Unit],
    devices: list[Device],
    draft: int,
    world: int,
    features_pass: bool = True,
) -> Plan:
    """Resolve ``placement`` over ``devices`` (``devices[0]`` is this process's own), or refuse with
    the numbers.

    ``features_pass``: for ``offline``, whether the target's pass over the data is still to run (it
    runs in one process, over every device); once its features are on disk, training plans only
    what it holds, the draft and the lm_head, on each process's own device.
    """
    resolved = _resolve(placement, units, devices, draft, world, features_pass)
    resolved.left_out = getattr(units, "left_out", 0)
    resolved.holding = getattr(units, "holding", Holding.DENSE)
    return resolved


def _resolve(
    placement: str, units: list[Unit], devices: list[Device], draft: int, world: int, features_pass: bool
) -> Plan:
    target = sum(u.weights for u in units)
    gpus = devices[0].name.startswith("cuda")
    if placement == "offline":
        features = plan("auto", units, devices, 0, 1) if features_pass else None
        # The lm_head, what offline training holds; tied to the embedding it is counted there, but
        # held alone it is a copy of it.
        embedding = units[0].weights
        head = [Unit(u.module, u.weights or embedding, u.activations) for u in units if "." not in u.module]
        shares = split(head, devices[:1], draft)
        if shares is None:
            raise PlacementError(
                f"offline training holds the draft ({format_size(draft)}) and the target's lm_head "
                f"({format_size(sum(u.weights for u in head))}); {devices[0].name} has "
                f"{format_size(devices[0].usable)} usable: lower --batch-size or --max-length"
            )
        if features is None:
            reason = "the target's features are on disk; training holds its lm_head"
        else:
            reason = f"the target writes its features once, {features.reason}; training holds its lm_head"
        return Plan("offline", reason, shares, features=features)
    if placement in ("auto", "replicated"):
        shares = split(units, devices[:1], draft)
        if shares is not None:
            where = devices[0].name if gpus else "this process's memory (no GPU)"
            beside = f" next to the draft ({format_size(draft)})" if draft else ""
            return Plan("replicated", f"the target ({format_size(target)}) fits {where}{beside}", shares)
        if placement == "replicated" or world > 1:
            ask = "replicated" if placement == "replicated" else "auto with several processes (replicated)"
            raise PlacementError(
                f"{ask}: the target ({format_size(target)} of weights) and the draft ({format_size(draft)}) "
                f"do not fit {devices[0].name} ({format_size(devices[0].free)} free, "
                f"{format_size(devices[0].usable)} usable): use --target-placement sharded (one process, "
                "every GPU) or offline"
            )
    if world > 1:
        raise PlacementError(
            f"--target-placement {placement} runs in one process over every GPU: drop --nproc/--nnodes "
            "(several processes each holding a share would need disjoint GPU sets, which eyrie does not plan)"
        )
    shares = split(units, devices, draft)
    if shares is None:
        raise PlacementError(_why_not_sharded(units, devices, draft))
    layers = sum(len(s.layers) for s in shares)
    reason = (
        f"the target ({format_size(target)}) does not fit one device next to the draft: "
        f"{layers} layers over {len(shares)} devices"
        if placement == "auto"
        else f"{layers} layers over {len(shares)} devices"
    )
    return Plan("sharded", reason, shares)


def _why_not_sharded(units: list[Unit], devices: list[Device], draft: int) -> str:
    """Why ``split`` found no plan, in numbers that agree: the draft alone is too large for the first
    device, the sum is too large for all of them, or modules placed whole and in order leave some
    over although the sum would fit."""
    target = sum(u.weights for u in units)
    activations = sum(u.activations for u in units)
    needed = target + activations + draft
    usable = sum(d.usable for d in devices)
    first = devices[0]
    if draft > first.usable:
        return (
            f"the draft needs {format_size(draft)} on {first.name}, which has {format_size(first.usable)} "
            f"usable ({format_size(first.free)} free, {HEADROOM:.0%} kept as headroom): lower --batch-size "
            "or --max-length"
        )
    if needed > usable:
        largest = max(units, key=lambda u: u.weights + u.activations)
        free = ", ".join(f"{d.name} {format_size(d.free)} free" for d in devices)
        return (
            f"the target needs {format_size(target)} of weights, {format_size(activations)} of activations, "
            f"the draft {format_size(draft)}: {format_size(needed)} in all, but the {len(devices)} device(s) "
            f"have {format_size(usable)} usable together ({free}; {HEADROOM:.0%} kept as headroom; largest "
            f"module {largest.module} {format_size(largest.weights + largest.activations)}): lower "
            "--batch-size or --max-length, free GPU memory, or use a host with more"
        )
    shares = [Share(d) for d in devices]
    shares[0].draft = draft
    pending = list(units)
    for share in shares:  # fill each device in turn, as far as whole modules go
        while pending and share.planned + pending[0].weights + pending[0].activations <= share.device.usable:
            share.take(pending.pop(0))
    if not pending:  # what tipped it is the transient each device keeps room for
        return (
            f"the target and the draft need {format_size(needed)} of the {format_size(usable)} usable, "
            "but no device keeps room for the dense weight a packed module makes while it runs (one "
            "expert's): lower --batch-size or --max-length, or use --target-placement offline"
        )
    left = sum(u.weights + u.activations for u in pending)
    return (
        f"the target ({format_size(target)} of weights, {format_size(activations)} of activations) and the "
        f"draft ({format_size(draft)}) need {format_size(needed)}, under the {format_size(usable)} the "
        f"{len(devices)} device(s) have usable together, but modules go whole and in order: {first.name} "
        f"holds the draft and {len(shares[0].modules)} module(s) ({format_size(shares[0].planned)}), and "
        f"filling every device leaves {len(pending)} module(s), from {pending[0].module}, left over "
        f"({format_size(left)}): lower --batch-size or --max-length (a smaller draft leaves {first.name} "
        "room for more layers), or use --target-placement offline"
    )


def measure_devices(every_gpu: bool) -> list[Device]:
    """The devices a plan may use, this process's own first: every GPU, or only this rank's
    (``LOCAL_RANK``), with their free memory; without GPUs, the CPU with this process's share of
    the memory budget (the node's ranks share it)."""
    import os

    import torch

    from pipeline.memory.budget import memory_budget

    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        others = [i for i in range(torch.cuda.device_count()) if i != local] if every_gpu else []
        order = [local, *others]
        return [Device(f"cuda:{i}", torch.cuda.mem_get_info(i)[0]) for i in order]
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return [Device("cpu", memory_budget().available // ranks)]
