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

from benchmarks.run_overhead import measure
from pipeline.run.docker import DockerExecutor
from pipeline.run.local import LocalExecutor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--image", default="eyrie-pipeline:local")
    args = parser.parse_args()
    local = measure(args.steps, chained=True, executor=LocalExecutor())
    docker = measure(args.steps, chained=True, executor=DockerExecutor(image=args.image))
    print(
        json.dumps(
            {
                "steps": args.steps,
                "local_s_per_step": round(local, 3),
                "docker_s_per_step": round(docker, 3),
                "target_docker_s_per_step": 3.0,
            }
        )
    )


if __name__ == "__main__":
    main()
