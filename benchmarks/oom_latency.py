"""OOM-detection latency: from the kernel's kill to the time eyrie records in the ledger.

The victim writes a timestamp after every MiB it allocates, so its last
timestamp is the moment of its death to within one allocation (~1 ms). The
parent process outlives it by a few seconds, so the recorded time comes from
the running monitor, not from the end of the attempt.

    python -m benchmarks.oom_latency [--trials 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import sys
import tempfile
from pathlib import Path

from benchmarks.run_overhead import Quiet
from pipeline.run.ledger import Ledger
from pipeline.run.local import LocalExecutor
from pipeline.run.orchestrator import Orchestrator
from pipeline.run.spec import PipelineSpec

VICTIM = r"""
import os, struct, subprocess, sys, time
if sys.argv[1] == "child":
    fd = os.open("last_alive", os.O_WRONLY | os.O_CREAT, 0o644)
    held = []
    while True:
        held.append(b"\x01" * (1 << 20))
        os.pwrite(fd, struct.pack("d", time.time()), 0)
else:
    subprocess.run([sys.executable, __file__, "child"])
    time.sleep(3)
"""


def trial(tmp: Path) -> float:
    script = tmp / "victim.py"
    script.write_text(VICTIM)
    spec = PipelineSpec.model_validate(
        {"steps": [{"name": "victim", "command": [sys.executable, str(script), "parent"], "memory": "96MiB"}]}
    )
    run_dir = tmp / "run"
    Orchestrator(spec, tmp / "pipeline.yaml", run_dir, LocalExecutor(), Quiet()).run()
    (attempt,) = Ledger(run_dir).attempts()
    assert attempt.verdict == "child_oom_killed", attempt.verdict
    last_alive = struct.unpack("d", (run_dir / "victim" / "last_alive").read_bytes())[0]
    return attempt.oom_at - last_alive


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args()
    latencies = []
    for _ in range(args.trials):
        with tempfile.TemporaryDirectory() as tmp:
            latencies.append(trial(Path(tmp)))
    print(
        json.dumps(
            {
                "trials": args.trials,
                "median_s": round(statistics.median(latencies), 3),
                "max_s": round(max(latencies), 3),
                "target_s": 1.0,
            }
        )
    )


if __name__ == "__main__":
    main()
