"""Training step on CPU: draft training tokens/s, process peak memory, and acceptance at K=7.

Uses the embedded tiny target and its self-distilled shards (built and cached on first use).
Each precision trains in a process of its own (its peak RSS is its own), on the same rows in the
same order for the same steps; prints one JSON line per precision, then bf16's against fp32's.

    .venv/bin/python -m benchmarks.train_cpu --steps 150 --threads 1 --precisions fp32 bf16
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from pipeline.embedded.tiny import ensure_distilled_shards, ensure_tiny_target
from pipeline.steps.eagle3.decoding import eos_ids_of, real_acceptance
from pipeline.steps.train.features import OnlineTarget
from pipeline.steps.train.loop import TrainConfig, simulated_acceptance, train


def measure(cfg: TrainConfig, eval_prompts: int, max_new_tokens: int = 64) -> dict:
    """Train with ``cfg``, then measure acceptance on its held-out rows."""
    started = time.monotonic()
    result = train(cfg, log=lambda _: None)
    train_s = time.monotonic() - started
    target, draft, heldout = result["target"], result["draft"].eval(), result["heldout"]
    source = OnlineTarget(target, result["summary"]["layer_ids"], draft.d2t, draft.t2d)
    simulated = simulated_acceptance(
        source,
        draft,
        heldout,
        cfg.ttt_steps,
        0,
        batch_size=cfg.batch_size,
        loss_chunk=cfg.loss_chunk,
        precision=result["summary"]["precision"],
    )
    started = time.monotonic()
    real = real_acceptance(
        target, draft, heldout[:eval_prompts], cfg.ttt_steps, max_new_tokens, eos_ids_of(target)
    )
    decode_s = time.monotonic() - started
    return {
        "precision": result["summary"]["precision"],
        "threads": cfg.threads,
        "steps": cfg.max_steps,
        "train_s": round(train_s, 1),
        "train_tokens_per_s": result["summary"]["tokens_per_s_this_run"],
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "acc": [round(a, 3) for a in simulated["acc"]],
        "simulated_acceptance_length": round(simulated["acceptance_length"], 2),
        "real_acceptance_length": round(real["acceptance_length"], 2),
        "verify_forwards": real["verify_forwards"],
        "decode_s": round(decode_s, 1),
    }


def run(precision: str, args: argparse.Namespace) -> dict:
    """One precision's measurement, in the process it is called in."""
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(
            data=ensure_distilled_shards(),
            target=ensure_tiny_target(),
            out_dir=Path(out),
            draft_vocab_size=2048,
            ttt_steps=7,
            lr=3e-3,
            batch_size=args.batch_size,
            max_steps=args.steps,
            heldout_fraction=0.15,
            checkpoint_every=10**9,
            threads=args.threads,
            precision=precision,
        )
        return measure(cfg, args.eval_prompts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--eval-prompts", type=int, default=16)
    parser.add_argument("--precisions", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    args = parser.parse_args()

    ensure_distilled_shards()  # built once, before the measured processes
    results = {}
    for precision in args.precisions:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            results[precision] = pool.submit(run, precision, args).result()
        print(json.dumps(results[precision]), flush=True)
    if {"fp32", "bf16"} <= results.keys():
        fp32, bf16 = results["fp32"], results["bf16"]
        accept = bf16["real_acceptance_length"] / fp32["real_acceptance_length"] - 1
        print(
            json.dumps(
                {
                    "bf16_vs_fp32_tokens_per_s": round(
                        bf16["train_tokens_per_s"] / fp32["train_tokens_per_s"], 2
                    ),
                    "bf16_vs_fp32_peak_rss": round(bf16["peak_rss_mib"] / fp32["peak_rss_mib"], 2),
                    "bf16_vs_fp32_real_acceptance_pct": round(100 * accept, 1),
                }
            )
        )


if __name__ == "__main__":
    main()
