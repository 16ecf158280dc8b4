"""The target's forward with its INT4 experts held packed, against the same model dequantized up front.

The target: the tests' Kimi-K2.5 in its real formats (``tests/fixtures/kimi_k25``: the
vision-language wrapper and its remote code, a DeepSeek-V3 text model, routed experts INT4
``pack-quantized`` in groups of 32 as Moonshot ships them), made at the size given. It is loaded by
eyrie's loader twice: held packed (what ``eyrie train`` does) and with ``dequantize=True`` (what
``--dequantize-target`` does, and what transformers' own route amounts to). Each way runs in fresh
processes, alternating A/B/A/B, ``--repeats`` times: load, one warm-up pass, then ``--passes`` passes
of the features forward (``OnlineTarget.hidden``: the aux and last hidden states, what the features
pass and online training compute) over ``--batch`` rows of ``--length`` tokens. Each process reports
its tokens/s over the passes, its peak memory and the bytes the loaded model holds in tensors.

On the CPU (the default) the model is fp32 and the peak is the process's resident memory
(``ru_maxrss``); with ``--device cuda`` it is bf16 on the first GPU, as ``eyrie train`` holds it
there, and the peak is the GPU memory torch allocated (``torch.cuda.max_memory_allocated``).

    python -m benchmarks.packed_forward [--hidden 512] [--experts 64] [--layers 4] [--repeats 3]
    python -m benchmarks.packed_forward --device cuda --hidden 7168 --expert-width 2048 \
        --experts 64 --layers 4 --length 2048   # Kimi-K2.5's widths; 64 of its 384 experts, 4 layers
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.memory.units import KIB, MIB

WAYS = ("packed", "dequantized")


def measure(folder: Path, way: str, batch: int, length: int, passes: int, threads: int, device: str) -> dict:
    """One process's figures for one way (run in a fresh process: its peak is its own)."""
    import torch

    from pipeline.steps.target import load_model
    from pipeline.steps.train.features import OnlineTarget

    torch.set_num_threads(threads)
    gpu = device == "cuda"
    started = time.perf_counter()
    model = load_model(
        folder,
        dtype=torch.bfloat16 if gpu else torch.float32,
        trust_remote_code=True,
        device_map={"": "cuda:0"} if gpu else None,
        dequantize=way == "dequantized",
    )
    loaded = time.perf_counter() - started
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    vocab = model.config.vocab_size
    layers = model.config.num_hidden_layers
    source = OnlineTarget(
        model, [0, layers // 2, layers - 2], torch.arange(2), torch.zeros(vocab, dtype=torch.bool)
    )
    ids = torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    out = torch.device(device)
    source.hidden(ids, mask, out)  # warm-up
    if gpu:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(passes):
        source.hidden(ids, mask, out)
    if gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB
    peak = torch.cuda.max_memory_allocated() if gpu else rss
    return {
        "way": way,
        "load_s": round(loaded, 2),
        "tokens_per_s": round(passes * batch * length / seconds, 1),
        "peak_bytes": peak,
        "held_bytes": held,
    }


def build(folder: Path, args: argparse.Namespace) -> None:
    from tests.fixtures.kimi_k25 import build_tiny_kimi

    build_tiny_kimi(
        folder,
        num_layers=args.layers,
        hidden_size=args.hidden,
        moe_intermediate_size=args.expert_width,
        n_routed_experts=args.experts,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512, help="hidden size")
    parser.add_argument("--expert-width", type=int, default=512, help="moe_intermediate_size")
    parser.add_argument("--experts", type=int, default=64, help="routed experts per layer")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (the first dense)")
    parser.add_argument("--batch", type=int, default=2, help="rows per forward")
    parser.add_argument("--length", type=int, default=512, help="tokens per row")
    parser.add_argument("--passes", type=int, default=3, help="timed forward passes per process")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--repeats", type=int, default=3, help="processes per way, alternating")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model runs")
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        figures = measure(
            args.folder, args.child, args.batch, args.length, args.passes, args.threads, args.device
        )
        print(json.dumps(figures))
        return
    with tempfile.TemporaryDirectory() as work:
        folder = Path(work) / "kimi"
        build(folder, args)
        stored = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        results: dict[str, list[dict]] = {way: [] for way in WAYS}
        for _ in range(args.repeats):
            for way in WAYS:
                argv = [
                    sys.executable,
                    "-m",
                    "benchmarks.packed_forward",
                    "--child",
                    way,
                    "--folder",
                    str(folder),
                ]
                passed = ("batch", "length", "passes", "threads", "device")
                argv += [f"--{k}={getattr(args, k)}" for k in passed]
                done = subprocess.run(argv, capture_output=True, text=True)
                if done.returncode:
                    sys.exit(f"{way}: {done.stderr.strip().splitlines()[-1]}")
                results[way].append(json.loads(done.stdout.strip().splitlines()[-1]))
    median = {
        way: {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "way"}
        for way, rows in results.items()
    }
    print(
        f"checkpoint: {stored / MIB:.1f} MiB of safetensors; {args.layers} layers, hidden {args.hidden}, "
        f"{args.experts} experts of width {args.expert_width}; {args.batch} x {args.length} tokens a pass"
    )
    peak = "peak CUDA memory" if args.device == "cuda" else "peak RSS"
    print(f"| way | tokens/s | {peak} | held in tensors | load |")
    print("|---|---|---|---|---|")
    for way in WAYS:
        m = median[way]
        print(
            f"| {way} | {m['tokens_per_s']:.0f} | {m['peak_bytes'] / MIB:.0f} MiB | "
            f"{m['held_bytes'] / MIB:.1f} MiB | {m['load_s']:.1f} s |"
        )
    packed, dense = median["packed"], median["dequantized"]
    print(
        f"packed / dequantized: tokens/s {packed['tokens_per_s'] / dense['tokens_per_s']:.2f}x, "
        f"{peak} {packed['peak_bytes'] / dense['peak_bytes']:.2f}x, "
        f"held {packed['held_bytes'] / dense['held_bytes']:.2f}x"
    )


if __name__ == "__main__":
    main()
