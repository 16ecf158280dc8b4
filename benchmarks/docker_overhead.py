"""Docker executor overhead per step, beside the local executor's, on the same chain.

A chain of N steps running `true` (each needs the one before, so nothing
overlaps). Under the Docker executor every step is a container: created with
its memory limit and labels, engine events subscribed, started, its PID 1
(pipeline.run.container_init) watching its cgroup, logs streamed, evidence
read, container removed. The step itself takes about a millisecond, so the
wall time per step is what the executor adds.

    python -m benchmarks.docker_overhead [--steps 10] [--image eyrie-pipeline:local]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.run_overhead import Quiet
from pipeline.run.docker import DockerExecutor
from pipeline.run.local import LocalExecutor
from pipeline.run.orchestrator import Orchestrator
from pipeline.run.spec import PipelineSpec


def measure(steps: int, executor) -> float:
    spec = PipelineSpec.model_validate({
        "steps": [
            {"name": f"s{i}", "command": ["true"], "memory": "64MiB", "needs": [f"s{i - 1}"] if i else []}
            for i in range(steps)
        ],
    })  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        pipeline = Path(tmp) / "pipeline.yaml"
        pipeline.write_text("")
        orchestrator = Orchestrator(spec, pipeline, Path(tmp) / "run", executor, Quiet())
        start = time.perf_counter()
        result = orchestrator.run()
        elapsed = time.perf_counter() - start
    assert result.state == "succeeded", result
    return elapsed / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--image", default="eyrie-pipeline:local")
    args = parser.parse_args()
    local = measure(args.steps, LocalExecutor())
    docker = measure(args.steps, DockerExecutor(image=args.image))
    print(json.dumps({"steps": args.steps, "local_s_per_step": round(local, 3),
                      "docker_s_per_step": round(docker, 3), "target_docker_s_per_step": 3.0}))  # fmt: skip


if __name__ == "__main__":
    main()
