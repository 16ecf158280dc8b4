"""Formats transformers itself computes with as stored on a GPU (``quant_method`` fp8, mxfp4,
nvfp4): planned at their stored size there, loaded by transformers' own quantizer."""

from __future__ import annotations

from pipeline.steps.target.holding import Held, Holding, NotHeld, OnGpu, QuantizationFormat

BLACKWELL = "a Blackwell GPU (compute capability 10.x or 12.x)"
ON_GPU = {
    "fp8": OnGpu(1.0),
    "mxfp4": OnGpu(0.5 + 1 / 32),
    # Two e2m1 weights a byte, an fp8 (e4m3) scale per 16 and an fp32 global scale per tensor; only
    # Blackwell's tensor cores (sm_100: B200, sm_120: RTX PRO 6000) compute with it.
    "nvfp4": OnGpu(0.5 + 1 / 16, (10, 12), BLACKWELL),
}


class NativeOnGpu(QuantizationFormat):
    def matches(self, quantization: dict) -> bool:
        return quantization.get("quant_method") in ON_GPU

    def held(self, quantization: dict, device_type: str, capability: tuple[int, int] | None) -> Held:
        stored = ON_GPU[quantization["quant_method"]]
        if stored.runs_on(device_type, capability):
            return Held(Holding.STORED, stored.bytes_per_weight)
        raise NotHeld(f"transformers runs it as stored only on {stored.gpus}")
