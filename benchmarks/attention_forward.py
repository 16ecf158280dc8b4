"""The target's features forward with flash-attn's kernels against PyTorch's SDPA, on a GPU host.

What ``eyrie train`` computes of the target (``OnlineTarget.hidden``: the aux and last hidden
states) over ``--batch`` rows padded to ``--length`` tokens, a quarter of each row padding, as a
batch of the seeds' rows is. The target is loaded by eyrie's own loader in bf16 on ``cuda:0`` and
switched between ``sdpa`` and ``flash_attention_2`` (``pipeline.steps.target.use_attention``),
alternating A/B/A/B ``--repeats`` times in one process; each way's tokens/s is the median of its
repeats, and its peak GPU memory the largest. It needs a CUDA device and the ``flash_attn`` package
(the pipeline image on a GPU host has it); elsewhere it says so and exits 2.

    python -m benchmarks.attention_forward --target Qwen/Qwen3-8B [--batch 8] [--length 4096]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time

WAYS = ("sdpa", "flash_attention_2")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="a model folder or hub id")
    parser.add_argument("--batch", type=int, default=8, help="rows per forward")
    parser.add_argument("--length", type=int, default=4096, help="tokens per row, padding included")
    parser.add_argument("--passes", type=int, default=5, help="timed forwards per repeat")
    parser.add_argument("--repeats", type=int, default=3, help="A/B rounds")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None:
        print(
            "error: needs a CUDA device and the flash_attn package (the pipeline image on a GPU host)",
            file=sys.stderr,
        )
        return 2
    from pipeline.steps.target import load_model, use_attention
    from pipeline.steps.train.features import OnlineTarget

    device = torch.device("cuda:0")
    model = load_model(args.target, dtype=torch.bfloat16, trust_remote_code=False, device_map={"": "cuda:0"})
    layers = model.config.num_hidden_layers
    vocab = model.config.vocab_size
    no_draft_vocab = (torch.arange(2), torch.zeros(vocab, dtype=torch.bool))  # the teacher is not timed
    source = OnlineTarget(model, [1, layers // 2, layers - 4], *no_draft_vocab, device=device)
    ids = torch.randint(3, vocab, (args.batch, args.length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[:, args.length * 3 // 4 :] = 0  # right padding, as train's batches are padded
    figures: dict[str, list[float]] = {way: [] for way in WAYS}
    peaks: dict[str, int] = dict.fromkeys(WAYS, 0)
    for _ in range(args.repeats):
        for way in WAYS:
            if use_attention(model, way) != way:
                print(f"error: {args.target} cannot take {way}", file=sys.stderr)
                return 2
            source.hidden(ids, mask, device)  # warm-up
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            for _ in range(args.passes):
                source.hidden(ids, mask, device)
            torch.cuda.synchronize()
            figures[way].append(args.passes * int(mask.sum()) / (time.perf_counter() - started))
            peaks[way] = max(peaks[way], torch.cuda.max_memory_allocated())
    result = {
        way: {"tokens_per_s": round(statistics.median(figures[way]), 1), "peak_gpu_bytes": peaks[way]}
        for way in WAYS
    }
    result["ratio_tokens_per_s"] = round(
        result["flash_attention_2"]["tokens_per_s"] / result["sdpa"]["tokens_per_s"], 3
    )
    print(json.dumps({"target": args.target, "batch": args.batch, "length": args.length, **result}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
