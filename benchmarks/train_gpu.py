"""Training step on one GPU: draft tokens/s, MFU on the draft's FLOPs, memory peak (bf16).

A random-init ~1.5B Llama target (hidden 2048, 16 layers, vocab 128256) is made on
the spot; batches are random tokens (the speed of a step does not depend on the
text). Online mode: every step runs the frozen target for features and teacher,
then the draft's K-step training-time test, backward and AdamW.

    python -m benchmarks.train_gpu --seq 2048 --batch 4 --steps 30 --peak-tflops 989
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.steps.eagle3.model import Eagle3Draft, default_layer_ids, draft_config, vocab_map
from pipeline.steps.train.features import OnlineTarget
from pipeline.steps.train.loop import DraftLoss


def draft_flops_per_token(config: LlamaConfig, steps: int, seq: int) -> float:
    """Training FLOPs (3x forward) of the draft per token, matmuls and attention, K steps."""
    H, inter, V = config.hidden_size, config.intermediate_size, config.draft_vocab_size
    heads, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    forward = 2 * 3 * H * H  # fc, once
    for k in range(steps):
        forward += 2 * 2 * H * (heads + 2 * kv) * hd + 2 * heads * hd * H  # q, k, v, o
        forward += 2 * 3 * H * inter + 2 * H * V  # MLP, lm_head
        forward += 2 * 2 * heads * hd * (seq / 2 + k)  # scores and weighted values, causal average
    return 3 * forward


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak (H200: 989)")
    # Smaller shapes and --device cpu give a smoke run of this script without a GPU.
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args()

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    target_config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        max_position_embeddings=8192,
    )
    target = LlamaForCausalLM(target_config).to(device, torch.bfloat16 if cuda else torch.float32).eval()
    layer_ids = default_layer_ids(target_config.num_hidden_layers)
    counts = torch.randint(0, 1000, (target_config.vocab_size,))
    d2t, t2d = vocab_map(counts, args.draft_vocab)
    draft = Eagle3Draft(draft_config(target_config, args.draft_vocab, layer_ids))
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.get_input_embeddings().weight.float())
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
    draft = draft.to(device)
    source = OnlineTarget(target, layer_ids, d2t, t2d)
    module = DraftLoss(draft, args.ttt, 0.8, chunk=1024)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=cuda)

    ids = torch.randint(0, target_config.vocab_size, (args.batch, args.seq), device=device)
    attention = torch.ones_like(ids)
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            teacher = source(ids, attention)
            loss, _ = module(ids, loss_mask, teacher)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()

    for _ in range(args.warmup):
        step()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    elapsed = time.perf_counter() - started
    tokens_per_s = args.batch * args.seq * args.steps / elapsed
    flops = draft_flops_per_token(draft.config, args.ttt, args.seq)
    # The target's forward is part of every online step but not of the draft's FLOPs.
    target_flops = 2 * sum(p.numel() for p in target.parameters())
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name() if cuda else "cpu",
                "seq": args.seq,
                "batch": args.batch,
                "ttt_steps": args.ttt,
                "draft_params_trainable": sum(p.numel() for p in params),
                "tokens_per_s": round(tokens_per_s),
                "draft_tflops_per_s": round(tokens_per_s * flops / 1e12, 1),
                "mfu_draft": round(tokens_per_s * flops / (args.peak_tflops * 1e12), 3),
                "mfu_draft_plus_target_forward": round(
                    tokens_per_s * (flops + target_flops) / (args.peak_tflops * 1e12), 3
                ),
                "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            }
        )
    )


if __name__ == "__main__":
    main()
