"""A target's format, decided once from its config: its language model's config and the prefix of
its weights' names, its quantization, how its weights are held on the device it runs on (and at how
many bytes a weight), and which loader reads them. The planner, the loader, the offline features
pass and SGLang's command line all read this one value (:class:`TargetFormat`).

The quantization formats are the classes registered in :data:`FORMATS` (one a file, in
``formats/``); a config quantized in a format none of them knows is refused, with its dense size,
wherever it would be planned or loaded.

Light on purpose (torch is imported only to ask a GPU its compute capability).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pipeline.memory.units import format_size
from pipeline.steps.target.formats.compressed_tensors import CompressedTensors
from pipeline.steps.target.formats.modelopt import ModelOpt
from pipeline.steps.target.formats.native import NativeOnGpu
from pipeline.steps.target.holding import (
    WHAT_EYRIE_HOLDS,
    Held,
    HeldFormatError,
    Holding,
    NotHeld,
    QuantizationFormat,
    as_dict,
    describe_device,
    gpu_capability,
)
from pipeline.steps.target.vision_language import language_config

FORMATS: tuple[QuantizationFormat, ...] = (CompressedTensors(), ModelOpt(), NativeOnGpu())
"""Every quantization format a target may be stored in, asked in this order."""
WRAPPED_PREFIX = "language_model."
"""What a vision-language wrapper's checkpoint names carry before its language model's own."""


class Loader(StrEnum):
    """What reads the target's weights."""

    TRANSFORMERS = "transformers"
    """transformers' ``from_pretrained``: the whole model, quantized by its own quantizer."""
    EYRIE = "eyrie"
    """The checkpoint's tensors read by name into the language model built on the meta device
    (:func:`pipeline.steps.target.quantized.load_held`): a wrapper's language model, packed
    weights, or quantized weights dequantized on purpose."""


@dataclass(frozen=True)
class Refusal:
    """Why a target cannot be held here."""

    reason: str
    with_dense_size: bool = True
    """The message ends with what its weights would need dequantized (known once it is built)."""

    def error(self, dense_bytes: int) -> HeldFormatError:
        if not self.with_dense_size:
            return HeldFormatError(self.reason)
        return HeldFormatError(
            f"{self.reason}; dequantized it would need {format_size(dense_bytes)} of weights"
        )


@dataclass(frozen=True)
class TargetFormat:
    """How one target is stored and held, as :func:`target_format` decided it for a device."""

    config: Any
    """The checkpoint's own config (a vision-language wrapper's, for Kimi-K2.5)."""
    text: Any
    """Its language model's config: a wrapper's ``text_config``, or ``config`` itself."""
    prefix: str
    """What the checkpoint's names carry before the language model's own (``language_model.``)."""
    quantization: dict
    """The checkpoint's quantization config (the language model's, or the wrapper's); empty: none."""
    scheme: QuantizationFormat | None
    """The registered format it is stored in; None: not quantized, or a format none knows."""
    holding: Holding | None
    """How its weights are held; None: they cannot be here (``refused`` says why)."""
    bytes_per_weight: float | None
    """For ``STORED``: bytes per quantized weight as held, its scales included."""
    ignore: tuple[str, ...] | None
    """For ``STORED``: the modules its checkpoint leaves unquantized; None: every Linear is quantized."""
    loader: Loader
    """What reads its weights."""
    refused: Refusal | None = None
    """Why it can be neither planned nor loaded here; raised once its dense size is known."""
    unreadable: str | None = None
    """Why no loader here reads its weights (it is planned, not loaded); None: one does."""

    @property
    def wrapped(self) -> bool:
        """Whether the target is a vision-language wrapper around its language model."""
        return self.text is not self.config

    @property
    def sglang_flags(self) -> list[str]:
        """What SGLang is told of the format beyond what it reads from the config."""
        return self.scheme.sglang_flags(self.quantization) if self.scheme is not None else []

    def check_readable(self) -> None:
        """A :class:`HeldFormatError` before any weight is read, when no loader here reads them (read
        as dense they would be garbage)."""
        if self.unreadable is not None:
            raise HeldFormatError(self.unreadable)


def quantization_of(config: Any, text: Any) -> dict:
    """The target's quantization config as a dict: its language model's, or its wrapper's."""
    for candidate in (config, text):
        quantization = as_dict(getattr(candidate, "quantization_config", None))
        if quantization:
            return quantization
    return {}


def format_of(quantization: dict) -> QuantizationFormat | None:
    """The registered format ``quantization`` is stored in, or None."""
    if not quantization.get("quant_method"):
        return None
    return next((known for known in FORMATS if known.matches(quantization)), None)


def target_format(
    config: Any,
    *,
    device_type: str = "cpu",
    capability: tuple[int, int] | None = None,
    dequantize: bool = False,
) -> TargetFormat:
    """The format of the target whose checkpoint config is ``config``, held on ``device_type``
    (``cuda``, ``cpu``) of compute ``capability`` (default: this process's GPU's); quantized weights
    are held as stored (packed, or computed with as stored) unless ``dequantize``."""
    text = language_config(config)
    wrapped = text is not config
    quantization = quantization_of(config, text)
    scheme = format_of(quantization)
    held, refused = _held(quantization, scheme, wrapped, device_type, capability, dequantize)
    holding = None if refused else held.holding
    eyrie = wrapped or holding is Holding.PACKED or (dequantize and bool(quantization))
    return TargetFormat(
        config=config,
        text=text,
        prefix=WRAPPED_PREFIX if wrapped else "",
        quantization=quantization,
        scheme=scheme,
        holding=holding,
        bytes_per_weight=held.bytes_per_weight,
        ignore=held.ignore,
        loader=Loader.EYRIE if eyrie else Loader.TRANSFORMERS,
        refused=refused,
        unreadable=scheme.unreadable(quantization) if scheme is not None else None,
    )


def _held(
    quantization: dict,
    scheme: QuantizationFormat | None,
    wrapped: bool,
    device_type: str,
    capability: tuple[int, int] | None,
    dequantize: bool,
) -> tuple[Held, Refusal | None]:
    """How the weights are held, or why they cannot be. A wrapper's format is asked even when it is
    to be dequantized: eyrie reads a wrapper's language model itself, and reads no stored format."""
    dense = Held(Holding.DENSE)
    method = quantization.get("quant_method")
    if not method or (dequantize and not wrapped):
        return dense, None
    if device_type == "cuda" and capability is None:
        capability = gpu_capability()
    try:
        if scheme is None:
            raise NotHeld(WHAT_EYRIE_HOLDS)
        stored = scheme.held(quantization, device_type, capability)
    except NotHeld as exc:
        label = scheme.label(quantization) if scheme is not None else str(method)
        where = describe_device(device_type, capability)
        reason = (
            f"the target is quantized as {label!r}, which cannot be held as stored on {where}: {exc.reason}"
        )
        return dense, Refusal(reason)
    if stored.holding is Holding.STORED and wrapped:
        # transformers runs FP8/MXFP4 as stored only through its own loading of the whole model;
        # eyrie's loader of a wrapper's language model reads only compressed-tensors INT weights.
        return stored, Refusal(
            f"the target is a vision-language wrapper whose language model is stored as {method!r}: eyrie "
            "loads a wrapper's language model itself and reads only compressed-tensors INT weights; use a "
            "checkpoint of the language model alone",
            with_dense_size=False,
        )
    return (dense if dequantize else stored), None
