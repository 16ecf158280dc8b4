"""compressed-tensors (llm-compressor's format; Kimi-K2.5's routed experts): INT weights held
packed by eyrie (:mod:`pipeline.steps.target.quantized`), 8-bit float weights as stored on a GPU."""

from __future__ import annotations

from typing import Any

from pipeline.steps.target.holding import Held, Holding, NotHeld, OnGpu, QuantizationFormat

COMPRESSED_TENSORS = "compressed-tensors"
FP8 = OnGpu(1.0)


def schemes(quantization: dict) -> list[tuple[Any, str]]:
    """(scheme, format) per config group."""
    from compressed_tensors.quantization import QuantizationScheme

    default = quantization.get("format")
    out = []
    for group in quantization.get("config_groups", {}).values():
        scheme = QuantizationScheme.model_validate(group)
        out.append((scheme, scheme.format or default))
    return out


class CompressedTensors(QuantizationFormat):
    def matches(self, quantization: dict) -> bool:
        return quantization.get("quant_method") == COMPRESSED_TENSORS

    def held(self, quantization: dict, device_type: str, capability: tuple[int, int] | None) -> Held:
        groups = schemes(quantization)
        kinds = {scheme.weights.type for scheme, _ in groups if scheme.weights is not None}
        if kinds <= {"int"}:
            return Held(Holding.PACKED)
        if kinds == {"float"} and all(s.weights.num_bits == 8 for s, _ in groups) and device_type == "cuda":
            return Held(Holding.STORED, FP8.bytes_per_weight)
        raise NotHeld("only its INT formats are held packed, FP8 as stored on a GPU")
