"""What `train` holds on each GPU in the real job: the placement planner's arithmetic, not a measurement.

The real job is pipeline/jobs/eagle3.yaml with its defaults: the target Qwen/Qwen3-8B (its
config.json's figures: 36 layers, hidden 4096, intermediate 12288, 32 heads of 128 with 8 KV
heads, vocabulary 151936, untied embedding), rows of 4096 tokens, batch 1, K=7, draft vocabulary
32000, loss chunk 512, eight processes on 8 GPUs of 96 GB (RTX PRO 6000 Blackwell), each taken
as 96e9 bytes less 1 GiB of CUDA context. The target and the draft are built on the meta device,
so every size is transformers' and the trainer's own count; the draft's needs are ``draft_bytes``,
the same estimate ``eyrie train`` plans with.

    python -m benchmarks.real_job_arithmetic [--length 4096] [--batch 1] [--ttt-steps 7]
"""

from __future__ import annotations

import argparse

import torch
from transformers import Qwen3Config

from pipeline.memory.units import format_size
from pipeline.steps.eagle3.model import Eagle3Draft, default_layer_ids, draft_config
from pipeline.steps.train.features import LOGITS_CHUNK
from pipeline.steps.train.placement import Device, draft_bytes, plan, target_units

QWEN3_8B = Qwen3Config(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
)
GPU_BYTES = 96 * 10**9
CONTEXT = 1024**3
PROCESSES = 8
DRAFT_VOCAB = 32000
LOSS_CHUNK = 512


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=4096, help="--max-length of the training rows")
    parser.add_argument("--batch", type=int, default=1, help="--batch-size")
    parser.add_argument("--ttt-steps", type=int, default=7, help="--ttt-steps (K)")
    args = parser.parse_args()

    units = target_units(QWEN3_8B, torch.bfloat16, args.batch, args.length, DRAFT_VOCAB, LOGITS_CHUNK)
    with torch.device("meta"):
        draft = Eagle3Draft(
            draft_config(QWEN3_8B, DRAFT_VOCAB, default_layer_ids(QWEN3_8B.num_hidden_layers))
        )
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in draft.parameters() if not p.requires_grad)
    tokens = args.batch * args.length
    total = draft_bytes(draft, tokens, args.length, args.ttt_steps, LOSS_CHUNK, 2, recompute=True)
    weights = sum(u.weights for u in units)

    print(f"target: {weights / 2 / 1e9:.2f}B parameters, {format_size(weights)} in bf16")
    print(f"draft: {trainable / 1e6:.0f}M trained parameters")
    print(
        f"  trained weights, gradients, AdamW moments, bf16 copy (18 B each): {format_size(18 * trainable)}"
    )
    print(f"  frozen embedding (fp32): {format_size(frozen)}")
    print(
        f"  the batch's inputs and activations (K={args.ttt_steps}, {tokens:,} tokens), buffers: "
        f"{format_size(total - 18 * trainable - frozen)}"
    )
    print(f"  in all: {format_size(total)}")
    devices = [Device("cuda:0", GPU_BYTES - CONTEXT)]  # under DDP each process plans its own GPU
    result = plan("auto", units, devices, total, world=PROCESSES)
    print(f"each of {PROCESSES} processes, {format_size(GPU_BYTES)} GPUs:")
    for line in result.describe():
        print("  " + line)


if __name__ == "__main__":
    main()
