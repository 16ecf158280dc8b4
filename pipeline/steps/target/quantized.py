"""Quantized targets held as stored: packed weights stay packed, dequantized only where the forward is.

Kimi-K2.5's routed experts are INT4 in compressed-tensors ``pack-quantized`` format (eight weights
in an int32, a scale per group of 32): ~595 GB as stored, ~2 TB dequantized. transformers 5.x
dequantizes such experts as it loads them (or, left compressed, when the model is first called),
so eyrie holds them itself, with compressed-tensors' own decompressor and transformers' own
extension points:

- a quantized ``nn.Linear`` (a per-expert projection, as the remote code Kimi ships has one per
  expert, or any other Linear the config targets) is replaced by :class:`PackedLinear`, which
  keeps the stored tensors and dequantizes its weight for each call;
- transformers' fused experts (``DeepseekV3Experts``: one 3-D tensor for all experts) keep each
  expert's stored tensors stacked, and run through an experts implementation registered in
  transformers' ``ExpertsInterface`` that dequantizes one expert at a time, for the tokens routed
  to it.

The dense weight of one expert (or Linear) lives only while its forward runs: that transient is
what a device holds beyond the stored bytes, and the planner counts both (:func:`packed_bytes`,
:func:`largest_transient`).

Which targets are held packed, and which formats are computed with as stored or refused, is decided
once, by :mod:`pipeline.steps.target.format`; this module holds packed weights and reads checkpoints.
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.steps.target.formats.compressed_tensors import schemes

PACKED_EXPERTS = "eyrie_packed"
"""The experts implementation (transformers' ``ExpertsInterface``) of fused experts held packed."""
_FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def stored_weights(module: nn.Module, name: str, ignore: tuple[str, ...] | None) -> int:
    """How many of the weights under ``module`` (``name``, as the checkpoint calls it) a format held
    as stored keeps quantized: its Linear weights, and with a list of the modules the checkpoint
    leaves unquantized (``ignore``, ModelOpt's) also fused experts' (each expert a Linear in the
    checkpoint), less those the list names."""
    if ignore is None:
        return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))
    quantized = 0
    for child_name, child in module.named_modules(prefix=name):
        if isinstance(child, nn.Linear):
            names = [child_name]
        elif _is_fused_experts(child):
            names = [f"{child_name}.0.{p}" for ps in _FUSED.values() for p in ps]
        else:
            continue
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names for pattern in ignore):
            quantized += sum(p.numel() for p in child.parameters(recurse=False) if p.dim() >= 2)
    return quantized


# ---------------------------------------------------------------- packed modules


def _dense(stored: dict[str, torch.Tensor], scheme: Any, fmt: str) -> torch.Tensor:
    """The dense weight of one module's stored tensors, by compressed-tensors' own decompressor."""
    from compressed_tensors.compressors import BaseCompressor

    return BaseCompressor.get_value_from_registry(fmt).decompress(dict(stored), scheme)["weight"]


def _stored_shapes(
    out_features: int, in_features: int, scheme: Any
) -> dict[str, tuple[tuple[int, ...], str]]:
    """The tensors compressed-tensors stores for one ``out x in`` weight: name -> (shape, kind)."""
    weights = scheme.weights
    groups = in_features // weights.group_size if weights.group_size else 1
    shapes = {
        "weight_packed": ((out_features, -(-in_features * weights.num_bits // 32)), "int32"),
        "weight_scale": ((out_features, groups), "scale"),
        "weight_shape": ((2,), "int64"),
    }
    if not weights.symmetric:
        shapes["weight_zero_point"] = ((-(-out_features * weights.num_bits // 32), groups), "int32")
    return shapes


def _empty(shape: tuple[int, ...], kind: str, scale_dtype: torch.dtype, device: Any) -> torch.Tensor:
    dtype = {"int32": torch.int32, "int64": torch.int64}.get(kind, scale_dtype)
    return torch.empty(shape, dtype=dtype, device=device)


class PackedLinear(nn.Module):
    """A Linear held as compressed-tensors stores it; the dense weight is made for each call."""

    def __init__(self, linear: nn.Linear, scheme: Any, fmt: str, scale_dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.scheme, self.format = scheme, fmt
        device = linear.weight.device
        for name, (shape, kind) in _stored_shapes(self.out_features, self.in_features, scheme).items():
            self.register_buffer(name, _empty(shape, kind, scale_dtype, device))
        self.bias = linear.bias

    def stored(self) -> dict[str, torch.Tensor]:
        return {name: buffer for name, buffer in self.named_buffers(recurse=False)}

    def dense_bytes(self, dtype: torch.dtype) -> int:
        return self.in_features * self.out_features * torch.finfo(dtype).bits // 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = _dense(self.stored(), self.scheme, self.format).to(x.dtype)
        return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))


def _hold_fused_experts(experts: nn.Module, scheme: Any, fmt: str, scale_dtype: torch.dtype) -> None:
    """Swap a fused experts module's dense 3-D weights for its experts' stored tensors, stacked:
    ``gate_up_proj`` holds each expert's gate and up projections' rows, one after the other."""
    experts.scheme, experts.format = scheme, fmt
    for fused in _FUSED:
        weight = getattr(experts, fused)
        count, out_features, in_features = weight.shape
        delattr(experts, fused)
        for name, (shape, kind) in _stored_shapes(out_features, in_features, scheme).items():
            if name == "weight_shape":
                shape = (len(_FUSED[fused]), 2)  # each projection's own shape, for the checkpoint's names
            experts.register_buffer(
                f"{fused}_{name}", _empty((count, *shape), kind, scale_dtype, weight.device)
            )


def _expert_weight(experts: nn.Module, fused: str, index: int) -> torch.Tensor:
    """One expert's dense ``fused`` weight (gate and up stacked, or down)."""
    stored = {
        name: getattr(experts, f"{fused}_{name}")[index]
        for name in ("weight_packed", "weight_scale", "weight_zero_point")
        if hasattr(experts, f"{fused}_{name}")
    }
    shapes = getattr(experts, f"{fused}_weight_shape")[index]
    stored["weight_shape"] = torch.stack([shapes[:, 0].sum(), shapes[0, 1]])
    return _dense(stored, experts.scheme, experts.format)


def packed_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' eager experts loop, with each expert's weights dequantized when tokens reach it."""
    out = torch.zeros_like(hidden_states)
    count = self.gate_up_proj_weight_packed.shape[0]
    with torch.no_grad():
        routed = F.one_hot(top_k_index, num_classes=count).permute(2, 1, 0)  # (expert, k, token)
        hit = routed.sum(dim=(-1, -2)).nonzero().flatten().tolist()
    for index in hit:
        position, token = torch.where(routed[index])
        state = hidden_states[token]
        gate_up = _expert_weight(self, "gate_up_proj", index).to(state.dtype)
        gate, up = F.linear(state, gate_up).chunk(2, dim=-1)
        down = _expert_weight(self, "down_proj", index).to(state.dtype)
        expert_out = F.linear(self.act_fn(gate) * up, down) * top_k_weights[token, position, None]
        out.index_add_(0, token, expert_out.to(out.dtype))
        del gate_up, down  # let the dense expert go before the next one is made
    return out


def _register_experts_implementation() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if PACKED_EXPERTS not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(PACKED_EXPERTS, packed_experts_forward)


def _is_fused_experts(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, name, None), nn.Parameter) for name in _FUSED) and (
        module.gate_up_proj.dim() == 3
    )


def _group_of(names: tuple[str, ...], module: nn.Module, groups: list[tuple[Any, str]], ignore: list[str]):
    """The (scheme, format) quantizing a module known by ``names``: its name in the checkpoint and in
    the language model, as a wrapper's quantization config may be written in either."""
    from compressed_tensors.utils.match import is_match

    if ignore and any(is_match(name, module, ignore) for name in names):
        return None
    for scheme, fmt in groups:
        if any(is_match(name, module, scheme.targets) for name in names):
            return scheme, fmt
    return None


def hold_packed(
    model: nn.Module, quantization: dict, prefix: str = "", scale_dtype: torch.dtype = torch.bfloat16
) -> int:
    """Replace the modules ``quantization`` (compressed-tensors') targets with packed ones,
    in place (on any device, meta included); returns how many were replaced.

    ``prefix``: what the checkpoint's names carry before the model's own (``language_model.`` in a
    vision-language wrapper), which the quantization config's targets and ignore list are written in.
    """
    groups = schemes(quantization)
    ignore = list(quantization.get("ignore") or [])
    replaced = fused = 0
    for name, module in list(model.named_modules()):
        full = f"{prefix}{name}"
        if isinstance(module, nn.Linear):
            found = _group_of((full, name), module, groups, ignore)
            if found is not None:
                parent, _, child = name.rpartition(".")
                packed = PackedLinear(module, *found, scale_dtype)
                setattr(model.get_submodule(parent) if parent else model, child, packed)
                replaced += 1
        elif _is_fused_experts(module):
            # Each expert's projections as the checkpoint names them, matched as the Linear they were.
            probe = nn.Linear(1, 1, device="meta")
            found = [
                _group_of((f"{full}.0.{p}", f"{name}.0.{p}"), probe, groups, ignore)
                for ps in _FUSED.values()
                for p in ps
            ]
            if found[0] is not None and all(group and group[0] is found[0][0] for group in found):
                _hold_fused_experts(module, *found[0], scale_dtype)
                fused += 1
    if fused:  # the fused experts' forward, through transformers' own switch
        _register_experts_implementation()
        model.set_experts_implementation(PACKED_EXPERTS)
    return replaced + fused


def largest_transient(module: nn.Module, dtype: torch.dtype) -> int:
    """The largest dense weight a packed module under ``module`` makes for one forward step:
    one Linear's, or one expert's gate, up and down projections together."""
    element = torch.finfo(dtype).bits // 8
    largest = 0
    for child in module.modules():
        if isinstance(child, PackedLinear):
            largest = max(largest, child.dense_bytes(dtype))
        elif hasattr(child, "gate_up_proj_weight_packed"):
            rows, hidden = child.gate_up_proj_weight_packed.shape[1], child.down_proj_weight_packed.shape[1]
            largest = max(largest, 3 * rows // 2 * hidden * element)  # gate and up, then down
    return largest


def packed_bytes(module: nn.Module) -> int:
    """Bytes of the stored (packed) tensors held under ``module``."""
    total = 0
    for child in module.modules():
        if isinstance(child, PackedLinear) or hasattr(child, "gate_up_proj_weight_packed"):
            total += sum(b.numel() * b.element_size() for b in child.buffers(recurse=False))
    return total


# ---------------------------------------------------------------- loading


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (an index, or the one ``model.safetensors``)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {name: folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    single = folder / "model.safetensors"
    if not single.is_file():
        return {}
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


class Checkpoint:
    """The checkpoint's tensors by name, each read from its file when asked."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.files = weight_files(folder)
        self._open: dict[Path, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(file, framework="pt")
        return self._open[file].get_tensor(name)


_EXPERT_TENSOR = re.compile(
    r"^(?P<experts>.+\.experts)\.(?P<fused>gate_up_proj|down_proj)_(?P<part>weight_\w+)$"
)


def _stacked_experts(checkpoint: Checkpoint, prefix: str, name: str, count: int) -> torch.Tensor | None:
    """A fused experts module's stacked tensor read from the checkpoint's per-expert tensors."""
    match = _EXPERT_TENSOR.match(name)
    if match is None:
        return None
    experts, fused, part = match["experts"], match["fused"], match["part"]
    per_expert = []
    for index in range(count):
        pieces = [checkpoint.get(f"{prefix}{experts}.{index}.{proj}.{part}") for proj in _FUSED[fused]]
        per_expert.append(torch.stack(pieces) if part == "weight_shape" else torch.cat(pieces))
    return torch.stack(per_expert)


def _device_of(name: str, device_map: dict[str, str] | None, default: str) -> str:
    if not device_map:
        return default
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        device = device_map.get(".".join(parts[:end]))
        if device is not None:
            return device
    return device_map.get("", default)


def _set(model: nn.Module, name: str, value: torch.Tensor) -> None:
    parent, _, child = name.rpartition(".")
    module = model.get_submodule(parent) if parent else model
    if child in module._parameters:
        module._parameters[child] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[child] = value


def _dequantized(
    checkpoint: Checkpoint, prefix: str, key: str, quantization: dict, count: int
) -> torch.Tensor | None:
    """A dense weight the checkpoint stores packed, dequantized (for a target held dense on purpose)."""
    groups, ignore = schemes(quantization), list(quantization.get("ignore") or [])
    probe = nn.Linear(1, 1, device="meta")

    def one(module_key: str) -> torch.Tensor | None:
        found = _group_of((module_key, module_key.removeprefix(prefix)), probe, groups, ignore)
        if found is None or f"{module_key}.weight_packed" not in checkpoint:
            return None
        stored = {
            part: checkpoint.get(f"{module_key}.{part}")
            for part in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
            if f"{module_key}.{part}" in checkpoint
        }
        return _dense(stored, *found)

    if key.endswith(".weight"):
        return one(key.removesuffix(".weight"))
    experts, _, fused = key.rpartition(".")
    if fused not in _FUSED:
        return None
    weights = [torch.cat([one(f"{experts}.{i}.{p}") for p in _FUSED[fused]]) for i in range(count)]
    return torch.stack(weights)


def load_held(
    model: nn.Module,
    folder: Path,
    prefix: str,
    dtype: torch.dtype,
    device_map: dict[str, str] | None,
    quantization: dict,
    default_device: str = "cpu",
) -> nn.Module:
    """Fill ``model`` (its parameters on the meta device, its buffers real) from the checkpoint in
    ``folder``, each tensor straight onto the device ``device_map`` gives its module: dense tensors
    at ``dtype``, packed ones as stored (a packed tensor the model holds dense is dequantized as it
    is read, by ``quantization``, the checkpoint's). Several devices are joined by accelerate's hooks."""
    from accelerate import dispatch_model

    checkpoint = Checkpoint(folder)
    persistent = model.state_dict(keep_vars=True)
    head = model.get_output_embeddings()
    tied = getattr(model.config, "tie_word_embeddings", False) and head is not None
    for name, tensor in persistent.items():
        key = f"{prefix}{name}"
        if key in checkpoint:
            value = checkpoint.get(key)
        else:
            value = _stacked_experts(checkpoint, prefix, name, tensor.shape[0])
            if value is None and quantization:
                value = _dequantized(
                    checkpoint, prefix, key, quantization, tensor.shape[0] if tensor.dim() == 3 else 0
                )
            if value is None:
                if tied and tensor is head.weight:
                    continue  # a tied lm_head is the embedding: tied below
                raise FileNotFoundError(f"no tensor {key} in the checkpoint's safetensors files in {folder}")
        if value.is_floating_point() and not name.endswith("weight_scale"):
            value = value.to(dtype)
        _set(model, name, value.to(_device_of(name, device_map, default_device)))
    for (
        name,
        buffer,
    ) in model.named_buffers():  # not in the checkpoint (rotary frequencies): where their module is
        if name not in persistent:
            _set(model, name, buffer.to(_device_of(name, device_map, default_device)))
    if tied:
        model.tie_weights()
    if len(set((device_map or {}).values())) > 1:
        dispatch_model(model, device_map)
    return model.eval()
