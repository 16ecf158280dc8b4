"""The draft's training step at long rows: peak memory and tokens/s against the row length T, the
TTT attention linear in T (each step's layer recomputed in the backward, or kept) beside the T×T
attention it replaced, with the planner's estimate next to every measured peak.

One training step is the trainer's own: ``DraftLoss`` (K TTT steps, the loss in chunks), backward,
AdamW. Each (variant, T) runs in a process of its own. Its peak is what the step's tensors add at
their highest to what was held before it (weights, inputs): from the profiler's record of every
allocation and free on a CPU (:func:`allocator_bytes`), ``torch.cuda.max_memory_allocated`` on a
GPU; beside it, the process's own high water mark (``ru_maxrss``), which adds what malloc keeps
of freed memory and the library code first run. The planner's figure is what the step adds: the
activations (``draft_activations``, kept + transient) and the gradients and AdamW moments (12 bytes
a trained parameter).

    python -m benchmarks.train_long                      # CPU, hidden 128, K=7, T = 512 ... 16384
    python -m benchmarks.train_long --gpu                # hidden 7168, 64 heads, T up to 32768, bf16
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time

import torch
from transformers import LlamaConfig

from pipeline.memory.units import format_size
from pipeline.steps.eagle3 import model as draft_model
from pipeline.steps.eagle3.model import Eagle3Draft, draft_config
from pipeline.steps.train.features import TargetBatch
from pipeline.steps.train.loop import DraftLoss
from pipeline.steps.train.placement import draft_activations

CPU_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "draft_vocab": 1024,
    "lengths": [512, 1024, 2048, 4096, 8192, 16384],
}
# Kimi-K2.5's draft: its hidden size and MLP, 64 heads of 128 over 8 KV heads, 32,000 draft tokens.
GPU_SHAPE = {
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "draft_vocab": 32000,
    "lengths": [2048, 4096, 8192, 16384, 32768],
}
# The T x T attention kept 6 bytes a score (fp32 softmax, its copy): past this it needs > 10 GiB here.
QUADRATIC_UP_TO = {"cpu": 4096, "cuda": 8192}
VARIANTS = ("quadratic", "kept", "recomputed")
LOSS_CHUNK = 512


def allocator_bytes(run) -> tuple[int, int]:
    """(held after, peak during) ``run``: what the CPU allocator hands out and has not taken back,
    from the profiler's record of every allocation and free."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        run()
    events = recorded.profiler.kineto_results.events()
    held = peak = 0
    for _, change in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        held += change  # an allocation's bytes, or minus a free's
        peak = max(peak, held)
    return held, peak


def quadratic_ttt_attention(q, keys, values):
    """The attention this replaced: each head's T×T scores plus a column per later step, one softmax."""
    group = q.shape[1] // keys[0].shape[1]
    keys = [k.repeat_interleave(group, dim=1) for k in keys]
    values = [v.repeat_interleave(group, dim=1) for v in values]
    T = q.shape[-2]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = [(q @ keys[0].transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~causal, float("-inf"))]
    scores += [(q * k).sum(-1, keepdim=True) / math.sqrt(q.shape[-1]) for k in keys[1:]]
    probs = torch.softmax(torch.cat(scores, -1), -1, dtype=torch.promote_types(q.dtype, torch.float32))
    probs = probs.to(q.dtype)
    out = probs[..., :T] @ values[0]
    for j, v in enumerate(values[1:], start=1):
        out = out + probs[..., T + j - 1 : T + j] * v
    return out


def build(shape: dict, device: str):
    target = LlamaConfig(
        vocab_size=4 * shape["draft_vocab"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=8,
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"],
    )
    return Eagle3Draft(draft_config(target, shape["draft_vocab"], [1, 3, 4])).to(device)


def one(shape: dict, variant: str, length: int, steps: int, device: str, timed: int) -> dict:
    """One (variant, T) in this process: a warm-up step, then ``timed`` steps; peak and tokens/s."""
    if variant == "quadratic":
        draft_model.ttt_attention = quadratic_ttt_attention
    draft = build(shape, device)
    trained = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    ids = torch.randint(0, 4 * shape["draft_vocab"], (1, length), device=device)
    inputs = TargetBatch(
        torch.randn(1, length, 3 * shape["hidden_size"], device=device),
        torch.randn(1, length, shape["draft_vocab"], device=device),
        torch.ones(1, length, dtype=torch.bool, device=device),
    )
    module = DraftLoss(draft, steps, 0.8, LOSS_CHUNK, recompute=variant == "recomputed")
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
    precision = torch.bfloat16 if device == "cuda" else None

    def step():
        with torch.autocast(device, dtype=precision, enabled=precision is not None):
            loss, _ = module(ids, ids >= 0, inputs)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    rss_before = _rss()
    step()  # the first step makes AdamW's moments: the timed ones and the measured one have them
    started = time.perf_counter()
    for _ in range(timed):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = allocator_bytes(step)[1] + 8 * trained  # the moments were made before the record
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    seconds = (time.perf_counter() - started) / timed
    kept, transient = draft_activations(
        draft.config, length, length, steps, LOSS_CHUNK, recompute=variant == "recomputed"
    )
    return {
        "variant": variant,
        "length": length,
        "peak": peak,
        "rss": rss,
        "tokens_per_s": length / seconds,
        "planned": kept + transient + 12 * trained,
    }


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", action="store_true", help="Kimi-K2.5's draft shape on cuda, bf16 autocast")
    parser.add_argument("--steps", type=int, default=7, help="TTT steps K")
    parser.add_argument("--lengths", help="comma-separated T (default: the shape's)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # VARIANT,T: run in this process
    args = parser.parse_args()
    shape, device = (GPU_SHAPE, "cuda") if args.gpu else (CPU_SHAPE, "cpu")
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else shape["lengths"]
    torch.set_num_threads(torch.get_num_threads())
    if args.one:
        variant, length = args.one.split(",")
        timed = 1 if int(length) >= 8192 else 2
        print(json.dumps(one(shape, variant, int(length), args.steps, device, timed)))
        return
    print(
        f"K={args.steps}, hidden {shape['hidden_size']}, {shape['num_attention_heads']} heads over "
        f"{shape['num_key_value_heads']} KV heads of {shape['head_dim']}, on {device}"
    )
    print("| T | variant | peak | planned | peak / planned | peak(T) / peak(T/2) | RSS added | tokens/s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    last: dict[str, int] = {}
    for length in lengths:
        for variant in VARIANTS:
            if variant == "quadratic" and length > QUADRATIC_UP_TO[device]:
                continue
            command = [
                sys.executable,
                "-m",
                "benchmarks.train_long",
                "--one",
                f"{variant},{length}",
                "--steps",
                str(args.steps),
            ] + (["--gpu"] if args.gpu else [])
            row = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
            growth = f"{row['peak'] / last[variant]:.2f}" if variant in last else ""
            last[variant] = row["peak"]
            ratio = row["peak"] / row["planned"]
            print(
                f"| {length:,} | {variant} | {format_size(row['peak'])} | {format_size(row['planned'])} | "
                f"{ratio:.2f} | {growth} | {format_size(row['rss'])} | {row['tokens_per_s']:,.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
