"""NVIDIA ModelOpt's checkpoints (GLM-5-NVFP4): planned at their stored size on a GPU that computes
with them, with ModelOpt's list of modules left unquantized; no loader here reads their weights
(transformers 5.x loads no pre-quantized NVFP4, eyrie's own reads compressed-tensors), SGLang serves
them."""

from __future__ import annotations

from pipeline.steps.target.formats.native import ON_GPU
from pipeline.steps.target.holding import WHAT_EYRIE_HOLDS, Held, Holding, NotHeld, QuantizationFormat

MODELOPT = "modelopt"
# SGLang's --quantization for each of ModelOpt's algorithms (its generic one reads the rest).
SGLANG_QUANTIZATION = {"nvfp4": "modelopt_fp4", "fp8": "modelopt_fp8"}


def _algorithm(quantization: dict) -> str:
    return str(quantization.get("quant_algo")).lower()


class ModelOpt(QuantizationFormat):
    def matches(self, quantization: dict) -> bool:
        return quantization.get("quant_method") == MODELOPT

    def label(self, quantization: dict) -> str:
        known = _algorithm(quantization) in ON_GPU
        return f"{quantization['quant_algo']} ({MODELOPT})" if known else MODELOPT

    def held(self, quantization: dict, device_type: str, capability: tuple[int, int] | None) -> Held:
        stored = ON_GPU.get(_algorithm(quantization))
        if stored is None:
            raise NotHeld(WHAT_EYRIE_HOLDS)
        if stored.runs_on(device_type, capability):
            return Held(Holding.STORED, stored.bytes_per_weight, tuple(quantization.get("ignore") or ()))
        raise NotHeld(f"only {stored.gpus} computes with it")

    def unreadable(self, quantization: dict) -> str:
        served = " ".join(self.sglang_flags(quantization))
        return (
            f"the target is stored by ModelOpt ({quantization.get('quant_algo')}): eyrie plans its weights "
            f"but loads none of ModelOpt's yet (SGLang serves it: {served})"
        )

    def sglang_flags(self, quantization: dict) -> list[str]:
        return ["--quantization", SGLANG_QUANTIZATION.get(_algorithm(quantization), MODELOPT)]
