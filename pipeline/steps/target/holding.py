"""How a target's weights are held, and what a quantization format says about it: the vocabulary
every format (``formats/``) answers in, and :mod:`pipeline.steps.target.format` reads.

Light on purpose (no torch): the train step's command imports it for its errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

WHAT_EYRIE_HOLDS = (
    "eyrie holds compressed-tensors INT weights packed, FP8 or MXFP4 as stored on a GPU, "
    "and NVFP4 on a Blackwell GPU"
)
"""Why a format no class here knows cannot be held."""


class Holding(StrEnum):
    """How a target's weights are held in memory."""

    DENSE = "dense"
    """Every weight at the load dtype."""
    PACKED = "packed"
    """Quantized weights kept as stored by eyrie, each dequantized only while its forward runs
    (compressed-tensors INT weights: :mod:`pipeline.steps.target.quantized`)."""
    STORED = "stored"
    """Quantized weights computed with as stored, on a GPU whose kernels take the format."""


class HeldFormatError(ValueError):
    """The target's format cannot be held as stored here; the message gives its dense size."""


@dataclass(frozen=True)
class Held:
    """What a format holds here: how, and for ``STORED`` at how many bytes a weight."""

    holding: Holding
    bytes_per_weight: float | None = None
    """For ``STORED``: bytes per quantized weight as held, its scales included."""
    ignore: tuple[str, ...] | None = None
    """For ``STORED``: the checkpoint's modules left unquantized (glob patterns, as ModelOpt writes
    them); None: every Linear is quantized (transformers' own FP8 and MXFP4)."""


class NotHeld(Exception):
    """A format's answer that it cannot be held here: ``reason`` says why, in a clause."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class OnGpu:
    """A format computed with as stored, on a GPU only."""

    bytes_per_weight: float
    """Bytes per quantized weight as held, its scales included."""
    architectures: tuple[int, ...] = ()
    """The compute capabilities (major) whose tensor cores compute with it; empty: any GPU."""
    gpus: str = "a GPU"

    def runs_on(self, device_type: str, capability: tuple[int, int] | None) -> bool:
        if device_type != "cuda":
            return False
        return not self.architectures or (capability is not None and capability[0] in self.architectures)


class QuantizationFormat:
    """One quantization format a checkpoint may be stored in: whether a quantization config is its,
    how it is held on a device, whether eyrie reads its weights, and what SGLang needs to serve it.
    A new format is a subclass in ``formats/``, registered in :data:`pipeline.steps.target.format.FORMATS`."""

    def matches(self, quantization: dict) -> bool:
        """Whether ``quantization`` (a checkpoint's ``quantization_config``) is stored in this format."""
        raise NotImplementedError

    def label(self, quantization: dict) -> str:
        """How messages name it."""
        return str(quantization.get("quant_method"))

    def held(self, quantization: dict, device_type: str, capability: tuple[int, int] | None) -> Held:
        """How it is held on ``device_type`` of compute ``capability``; :class:`NotHeld` if it cannot be."""
        raise NotImplementedError

    def unreadable(self, quantization: dict) -> str | None:
        """Why no loader here reads its weights (a sentence), or None: one does."""
        return None

    def sglang_flags(self, quantization: dict) -> list[str]:
        """The flags SGLang serves it with, beyond what it reads from the config."""
        return []


def gpu_capability() -> tuple[int, int] | None:
    """This process's GPU's compute capability (``(12, 0)``: sm_120), or None without one."""
    import torch

    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def describe_device(device_type: str, capability: tuple[int, int] | None) -> str:
    """``cuda (sm_120)``, or the device type alone."""
    return (
        f"cuda (sm_{capability[0]}{capability[1]})" if capability and device_type == "cuda" else device_type
    )


def as_dict(quantization: Any) -> dict:
    """A quantization config as a dict (transformers may hand one over as an object)."""
    if not quantization:
        return {}
    return quantization if isinstance(quantization, dict) else quantization.to_dict()
