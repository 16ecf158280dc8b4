"""Where Kimi-K2.5 can live on the seeds' host: the placement planner's arithmetic, not a measurement.

The target: Kimi-K2.5's language model as its config.json gives it (the copy in
tests/fixtures/kimi_k25_release/, its ``text_config``: the DeepSeek-V3 architecture, 61 layers, the
first dense; hidden 7168; MLA with q_lora_rank 1536, kv_lora_rank 512, head dims 128 + 64 and 128;
384 routed experts of width 2048, 8 per token, one shared expert; vocabulary 163840), built on the
meta device, so every size is transformers' own count of its parameters. As released (its
``quantization_config``), the routed experts are INT4 with a bf16 scale per group of 32 weights
(4.5 bits a weight); everything else is bf16.

The host: 8 GPUs of 96 GB (RTX PRO 6000 Blackwell), each taken as 96e9 bytes less 1 GiB for the
CUDA context, and 449 GB of RAM. The draft: the trainer's own, sized by ``draft_bytes``.

The planner is run on two figures for the target's weights: with the routed experts held INT4 (what
an engine with W4A16 MoE kernels keeps in memory), and dense bf16 (what eyrie's planner counts for a
quantized checkpoint, and what transformers' compressed-tensors route computes with: it decompresses
the weights on the first forward pass).

    python -m benchmarks.placement_arithmetic [--length 2048] [--batch 1] [--tokens 100000000]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig

from pipeline.memory.units import format_size
from pipeline.steps.train.features import LOGITS_CHUNK
from pipeline.steps.train.model import Eagle3Draft, default_layer_ids, draft_config
from pipeline.steps.train.offline import bytes_per_token
from pipeline.steps.train.placement import Device, PlacementError, Unit, draft_bytes, plan, target_units

KIMI_K25_RELEASE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "kimi_k25_release"
GPU_BYTES = 96 * 10**9
CONTEXT = 1024**3
GPUS = 8
DRAFT_VOCAB = 32000


def kimi_k25() -> tuple[PreTrainedConfig, float]:
    """Kimi-K2.5's language model, without its quantization (the planner counts a dense model), and
    the bytes a routed expert's weight takes as released: its bits, and a bf16 scale per group."""
    text = AutoConfig.from_pretrained(KIMI_K25_RELEASE).text_config
    (group,) = text.quantization_config["config_groups"].values()
    del text.quantization_config
    weights = group["weights"]
    return text, weights["num_bits"] / 8 + 2 / weights["group_size"]


def routed_expert_parameters(config) -> dict[str, int]:
    """Parameters of the routed experts in each decoder layer (by module name)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return {
        f"model.layers.{i}": sum(p.numel() for p in layer.mlp.experts.parameters())
        for i, layer in enumerate(model.model.layers)
        if hasattr(layer.mlp, "experts")
    }


def show(title: str, placement: str, units: list[Unit], devices: list[Device], draft: int) -> None:
    print(f"\n{title} --target-placement {placement}:")
    try:
        for line in plan(placement, units, devices, draft, world=1).describe():
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

    config, int4_bytes = kimi_k25()
    dense = target_units(config, torch.bfloat16, args.batch, args.length, DRAFT_VOCAB, LOGITS_CHUNK)
    experts = routed_expert_parameters(config)
    int4 = [
        Unit(u.module, u.weights - experts.get(u.module, 0) * (2 - int4_bytes), u.activations) for u in dense
    ]
    with torch.device("meta"):
        layers = default_layer_ids(config.num_hidden_layers)
        draft_model = Eagle3Draft(draft_config(config, DRAFT_VOCAB, layers))
    draft = draft_bytes(draft_model, args.batch * args.length, args.length, 7, 512, 2)
    devices = [Device(f"cuda:{i}", GPU_BYTES - CONTEXT) for i in range(GPUS)]

    total = sum(u.weights for u in dense) // 2
    routed = sum(experts.values())
    print(f"parameters: {total / 1e9:.1f}B, of which routed experts {routed / 1e9:.1f}B")
    print(f"weights, routed experts INT4: {format_size(int(sum(u.weights for u in int4)))}")
    print(f"weights, dense bf16:          {format_size(sum(u.weights for u in dense))}")
    print(f"draft (K=7, {args.batch} x {args.length} tokens, vocabulary {DRAFT_VOCAB}): {format_size(draft)}")
    print(f"GPUs: {GPUS} x {format_size(GPU_BYTES)}, {format_size(GPUS * (GPU_BYTES - CONTEXT))} free in all")
    per_token = bytes_per_token(config.hidden_size, torch.bfloat16)
    disk = format_size(per_token * args.tokens)
    print(f"offline features: {per_token:,} bytes a token; {args.tokens:,} tokens: {disk}")
    show("experts INT4", "replicated", int4, devices, draft)
    show("experts INT4", "auto", int4, devices, draft)
    show("dense bf16", "auto", dense, devices, draft)
    show("experts INT4", "offline", int4, devices, draft)


if __name__ == "__main__":
    main()
