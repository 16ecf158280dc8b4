"""The generation step's throughput from a target service of N replicas against one, side by side.

A pipeline of one step, ``eyrie generate``, that uses a ``target`` service: ``eyrie serve --engine
transformers`` on the tiny target (pipeline/embedded/tiny.py), continuous batching, one intra-op
thread per server. The same prompts (first user turns of the bundled samples), greedy, a fixed
max_tokens, the same requests in flight in all (``--in-flight``, spread over the replicas);
runs alternate 1, N, 1, N… (``--repeats`` each) under the executor given (``slurm``: each
replica a job). Throughput is the rows generate wrote over the wall time of its attempt in the
ledger (the servers are ready before it starts, so their loading is not in it).

    .venv/bin/python -m benchmarks.service_replicas --executor slurm --replicas 2 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from rich.console import Console

from benchmarks.generate_serve_concurrency import write_prompts
from pipeline.embedded.tiny import ensure_tiny_target
from pipeline.run.ledger import Ledger

REPO = Path(__file__).resolve().parents[1]


def pipeline(model: Path, prompts: Path, replicas: int, in_flight: int, max_tokens: int) -> dict:
    return {
        "name": f"service-replicas-{replicas}",
        "services": [
            {
                "name": "target",
                "command": [
                    "eyrie",
                    "serve",
                    str(model),
                    "--port",
                    "${EYRIE_SERVICE_PORT}",
                    "--engine",
                    "transformers",
                ],
                "memory": "3GiB",
                "replicas": replicas,
                "startup_timeout": "10m",
            }
        ],
        "steps": [
            {
                "name": "generate",
                "command": [
                    "eyrie",
                    "generate",
                    str(prompts),
                    "--max-tokens",
                    str(max_tokens),
                    "--temperature",
                    "0",
                    "--concurrency",
                    str(max(1, in_flight // replicas)),
                ],
                "memory": "1GiB",
                "uses": ["target"],
            }
        ],
    }


def one_run(root: Path, name: str, spec: dict, executor: str) -> float:
    """Rows per second of generate's attempt in a fresh run of ``spec``."""
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    run_dir = root / name
    argv = [sys.executable, "-m", "pipeline.cli", "run", str(path), "--run-dir", str(run_dir)]
    done = subprocess.run([*argv, "--executor", executor], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
    ledger = Ledger(run_dir, create=False)
    try:
        (attempt,) = ledger.attempts("generate")
    finally:
        ledger.close()
    rows = len((run_dir / "generate" / "conversations.jsonl").read_text().splitlines())
    asked = len(Path(spec["steps"][0]["command"][2]).read_text().splitlines())
    if rows != asked:
        raise SystemExit(f"{name}: generate wrote {rows} rows of {asked}")
    return rows / attempt.wall_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executor", default="slurm")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--in-flight", type=int, default=8)
    args = parser.parse_args()

    console = Console()
    with tempfile.TemporaryDirectory(prefix="eyrie-bench-replicas-") as tmp:
        root = Path(tmp)
        model = ensure_tiny_target(root / "model")
        prompts = root / "prompts.jsonl"
        write_prompts(prompts, args.prompts)
        rates: dict[int, list[float]] = {1: [], args.replicas: []}
        for repeat in range(args.repeats):
            for replicas in rates:
                spec = pipeline(model, prompts, replicas, args.in_flight, args.max_tokens)
                rate = one_run(root, f"r{replicas}-{repeat}", spec, args.executor)
                rates[replicas].append(rate)
                console.print(f"replicas {replicas}, run {repeat + 1}: {rate:.2f} rows/s")
        one, many = (statistics.median(rates[n]) for n in rates)
        console.print(
            f"median rows/s: 1 replica {one:.2f}, {args.replicas} replicas {many:.2f}; "
            f"ratio {many / one:.2f}x ({args.executor}, {args.prompts} prompts, {args.max_tokens} tokens, "
            f"{args.in_flight} in flight)"
        )


if __name__ == "__main__":
    main()
