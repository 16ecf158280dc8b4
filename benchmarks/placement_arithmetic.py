"""Where Kimi-K2.5 can live on the seeds' host: the placement planner's arithmetic, not a measurement.

The target: Kimi-K2.5's config.json as shipped (``tests/fixtures/kimi_k25_release/``, no weights),
read by transformers' own ``kimi_k25`` classes: the vision-language wrapper, its DeepSeek-V3
language model (61 layers, the first dense; hidden 7168; MLA; 384 routed experts of width 2048, 8
per token, one shared; vocabulary 163840) and its quantization config (routed experts INT4
``pack-quantized``, a bf16 scale per group of 32). The planner builds the language model on the meta
device held as ``eyrie train`` holds it (the experts packed:
``pipeline/steps/target/quantized.py``), so every size is its own count of the tensors it would
hold; and once more dequantized (``--dequantize-target``), for comparison.

The host: 8 GPUs of 96 GB (RTX PRO 6000 Blackwell), each taken as 96e9 bytes less 1 GiB for the
CUDA context, and 449 GB of RAM. The draft: the trainer's own, sized by ``draft_bytes``.

    python -m benchmarks.placement_arithmetic [--length 2048] [--batch 1] [--tokens 100000000]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig, PreTrainedConfig

from pipeline.memory.units import format_size
from pipeline.steps.eagle3.model import Eagle3Draft, default_layer_ids, draft_config
from pipeline.steps.train.features import LOGITS_CHUNK
from pipeline.steps.train.offline import bytes_per_token
from pipeline.steps.train.placement import Device, PlacementError, draft_bytes, plan, target_units

KIMI_K25_RELEASE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "kimi_k25_release"
GPU_BYTES = 96 * 10**9
CONTEXT = 1024**3
GPUS = 8
DRAFT_VOCAB = 32000


def kimi_k25() -> PreTrainedConfig:
    """Kimi-K2.5's config as shipped (the wrapper, its text config and quantization)."""
    return AutoConfig.from_pretrained(KIMI_K25_RELEASE)


def kimi_units(length: int = 2048, batch: int = 1, dequantize: bool = False):
    """Kimi-K2.5's language model as the planner counts it on a GPU: held packed, or dequantized."""
    return target_units(
        kimi_k25(),
        torch.bfloat16,
        batch,
        length,
        DRAFT_VOCAB,
        LOGITS_CHUNK,
        device_type="cuda",
        dequantize=dequantize,
    )


def kimi_plan(placement: str, length: int = 2048, batch: int = 1, dequantize: bool = False):
    """The planner's plan for Kimi-K2.5 on the seeds' host (raises PlacementError when refused)."""
    units = kimi_units(length, batch, dequantize)
    draft = draft_of(kimi_k25().text_config, length, batch)
    return plan(placement, units, host_gpus(), draft, world=1), units


def host_gpus() -> list[Device]:
    return [Device(f"cuda:{i}", GPU_BYTES - CONTEXT) for i in range(GPUS)]


def draft_of(text, length: int, batch: int) -> int:
    with torch.device("meta"):
        draft = Eagle3Draft(draft_config(text, DRAFT_VOCAB, default_layer_ids(text.num_hidden_layers)))
    return draft_bytes(draft, batch * length, length, 7, 512, 2, recompute=True)


def show(title: str, placement: str, args, dequantize: bool = False) -> None:
    print(f"\n{title} --target-placement {placement}:")
    try:
        result, _ = kimi_plan(placement, args.length, args.batch, dequantize)
        for line in result.describe():
            print("  " + line)
    except PlacementError as refused:
        print(f"  refused: {refused}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=2048, help="--max-length of the training rows")
    parser.add_argument("--batch", type=int, default=1, help="--batch-size")
    parser.add_argument(
        "--tokens", type=int, default=100_000_000, help="training tokens, for the offline disk"
    )
    args = parser.parse_args()

    text = kimi_k25().text_config
    packed = kimi_units(args.length, args.batch)
    dense = kimi_units(args.length, args.batch, dequantize=True)
    print(
        f"weights held packed:  {format_size(sum(u.weights for u in packed))} "
        f"({format_size(sum(u.packed for u in packed))} of them packed); vision tower not loaded: "
        f"{format_size(packed.left_out)}"
    )
    print(f"weights dequantized:  {format_size(sum(u.weights for u in dense))}")
    print(
        f"draft (K=7, {args.batch} x {args.length} tokens, vocabulary {DRAFT_VOCAB}): "
        f"{format_size(draft_of(text, args.length, args.batch))}"
    )
    print(f"GPUs: {GPUS} x {format_size(GPU_BYTES)}, {format_size(GPUS * (GPU_BYTES - CONTEXT))} free in all")
    per_token = bytes_per_token(text.hidden_size, torch.bfloat16)
    disk = format_size(per_token * args.tokens)
    print(f"offline features: {per_token:,} bytes a token; {args.tokens:,} tokens: {disk}")
    for placement in ("replicated", "sharded", "offline"):
        show("experts packed", placement, args)
    show("dequantized", "sharded", args, dequantize=True)


if __name__ == "__main__":
    main()
