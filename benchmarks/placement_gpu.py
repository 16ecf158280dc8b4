"""The placements on GPUs: tokens/s, MFU, and the bytes each GPU held next to the plan's prediction.

A random-initialized target of a real configuration is made on the spot (nothing is downloaded):
the dense Llama-3.1-8B shape, or a small DeepSeek-V3-style mixture of experts (16B, 64 experts);
rows are random tokens. Each placement trains ``--steps`` steps through ``train()`` itself
(planning, loading by the planned device map, the loop), so what is measured is the trainer's
own path. Printed per placement, as JSON: the plan's bytes per device, each device's measured
peak (``torch.cuda.max_memory_allocated``), tokens/s, and MFU over the target's forward and the
draft's training FLOPs against ``--peak-tflops`` per GPU.

    python -m benchmarks.placement_gpu --target dense-8b --placements replicated,sharded --steps 20
    python -m benchmarks.placement_gpu --target tiny --steps 4        # smoke run, CPU
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig

from benchmarks.train_gpu import draft_flops_per_token
from pipeline.steps.eagle3.model import Eagle3Draft, default_layer_ids, draft_config
from pipeline.steps.train.loop import TrainConfig, train

TARGETS = {
    "dense-8b": LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
    ),
    "moe-16b": DeepseekV3Config(
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        first_k_dense_replace=1,
        n_routed_experts=64,
        num_experts_per_tok=6,
        n_shared_experts=2,
        n_group=1,
        topk_group=1,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    ),
    "tiny": LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    ),
}


def active_parameters(model) -> int:
    """Parameters one token goes through: all but the routed experts it is not sent to."""
    total = sum(p.numel() for p in model.parameters())
    config = model.config
    experts = getattr(config, "n_routed_experts", None)
    if not experts:
        return total
    routed = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    return total - routed + routed * config.num_experts_per_tok // experts


def make_inputs(folder: Path, config, rows: int, length: int) -> tuple[Path, Path, int]:
    """A random-init target saved as a model folder, shards of random tokens, and the target's active
    parameters."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder / "target")
    active = active_parameters(model)
    del model
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(2, config.vocab_size, (rows, length), generator=generator).tolist()
    (folder / "shards").mkdir()
    table = pa.table({"input_ids": ids, "loss_mask": [[0] * 8 + [1] * (length - 8)] * rows})
    pq.write_table(table, folder / "shards" / "shard-00000.parquet")
    return folder / "target", folder / "shards", active


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", choices=sorted(TARGETS), default="dense-8b")
    parser.add_argument("--placements", default="replicated,sharded")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument(
        "--peak-tflops", type=float, default=989.0, help="bf16 dense peak per GPU (H200: 989)"
    )
    args = parser.parse_args()

    config = TARGETS[args.target]
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as tmp:
        rows = args.steps * args.batch + 8
        target, shards, active = make_inputs(
            Path(tmp), config, rows, min(args.seq, config.max_position_embeddings)
        )
        draft_vocab = min(args.draft_vocab, config.vocab_size)
        with torch.device("meta"):
            draft = Eagle3Draft(
                draft_config(config, draft_vocab, default_layer_ids(config.num_hidden_layers))
            )
        flops = draft_flops_per_token(draft.config, args.ttt, args.seq) + 2 * active
        for placement in args.placements.split(","):
            cfg = TrainConfig(
                data=shards,
                target=target,
                out_dir=Path(tmp) / placement,
                target_placement=placement,
                draft_vocab_size=args.draft_vocab,
                ttt_steps=args.ttt,
                batch_size=args.batch,
                max_length=args.seq,
                max_steps=args.steps,
                checkpoint_every=args.steps,
                log_every=args.steps,
                heldout_fraction=0.0,
                eval_prompts=0,
            )
            for i in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(i)
            summary = train(cfg, log=lambda _: None)["summary"]
            plan = summary["target_placement"]
            devices = [
                {
                    "device": d["device"],
                    "layers": d["layers"],
                    "planned_gib": round(d["planned_bytes"] / 2**30, 2),
                    "peak_gib": round(torch.cuda.max_memory_allocated(d["device"]) / 2**30, 2)
                    if cuda
                    else None,
                }
                for d in plan["devices"]
            ]
            tokens_per_s = summary["tokens_per_s_this_run"]
            gpus = max(1, len(devices)) if cuda else 1
            report = {
                "target": args.target,
                "placement": plan["placement"],
                "device": torch.cuda.get_device_name() if cuda else "cpu",
                "tokens_per_s": tokens_per_s,
                "mfu": round(tokens_per_s * flops / (args.peak_tflops * 1e12 * gpus), 4),
                "devices": devices,
            }
            print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
