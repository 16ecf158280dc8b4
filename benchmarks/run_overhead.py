"""Orchestration overhead per step: what eyrie adds around a step that does nothing.

A chain of N steps running `true` (each needs the one before, so nothing
overlaps) and N independent ones. Every step gets its own cgroup, a ledger
row, its memory monitor, its manifest and its log files; the step itself
takes about a millisecond, so the wall time per step is eyrie's overhead.

    python -m benchmarks.run_overhead [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from pipeline.run.executor import Executor
from pipeline.run.local import LocalExecutor
from pipeline.run.orchestrator import Orchestrator
from pipeline.run.spec import PipelineSpec


class Quiet:
    def line(self, *a): ...
    def started(self, *a): ...
    def ended(self, *a): ...
    def skipped(self, *a): ...
    def blocked(self, *a): ...
    def note(self, *a): ...


def measure(steps: int, chained: bool, executor: Executor | None = None) -> float:
    """Wall seconds per step of N `true` steps, chained or independent, under ``executor``."""
    spec = PipelineSpec.model_validate(
        {
            "steps": [
                {
                    "name": f"s{i}",
                    "command": ["true"],
                    "memory": "64MiB",
                    "needs": [f"s{i - 1}"] if chained and i else [],
                }
                for i in range(steps)
            ],
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        pipeline = Path(tmp) / "pipeline.yaml"
        pipeline.write_text("")
        orchestrator = Orchestrator(spec, pipeline, Path(tmp) / "run", executor or LocalExecutor(), Quiet())
        start = time.perf_counter()
        result = orchestrator.run()
        elapsed = time.perf_counter() - start
    assert result.state == "succeeded", result
    return elapsed / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    chained = measure(args.steps, chained=True)
    parallel = measure(args.steps, chained=False)
    print(
        json.dumps(
            {
                "steps": args.steps,
                "chained_s_per_step": round(chained, 3),
                "independent_s_per_step": round(parallel, 3),
                "target_s_per_step": 0.5,
            }
        )
    )


if __name__ == "__main__":
    main()
