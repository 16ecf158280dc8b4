"""Benchmark 1: real flash-attn translation units, one arch, under a budget naive parallelism exceeds.

In one run, the same subset of flash-attn 2.8.3's .cu files is compiled with
the nvcc flags its real setup.py gives torch's ninja file:

- ``ninja -j N`` (fixed MAX_JOBS = N) with the real nvcc, the whole ninja run in
  one cgroup limited to the budget — what a container with that memory does;
- eyrie's scheduler: the same ninja file with the broker's nvcc stand-in,
  every job in its own cgroup under a build cgroup limited to the budget,
  predictions from the shipped profiles; ninja offers every file at once
  (``-j`` = the number of files), the broker chooses what runs.

For each: OOM kills (and re-runs), whether the build completed, wall time,
and for the scheduler how many reservations shrank after their job's peak.

Run (about half an hour on 2 quiet cores):
  .venv/bin/python -m benchmarks.build_flash_attn_subset --source DIR --python CUDA_TORCH_PY
      [--headers-python PY] [--cxx-standard c++20] [--budget 11.75GiB] [--max-jobs 2,1]
      [--arch 120] [--threads 1]
CUDA_HOME (default /usr/local/cuda-13.0) picks the nvcc.
CUDA_TORCH_PY is a Python with a CUDA build of torch (setup.py needs one to write its
ninja file); --headers-python one whose torch headers to compile with (default: the same);
--cxx-standard c++20 for torch >= 2.13's headers, as ``eyrie build flash-attn`` does.
DIR is an unpacked flash-attn 2.8.3 sdist (``pip download --no-deps --no-binary :all:
flash-attn==2.8.3`` with FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE, then untar).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.compile_subset import (
    setup_ninja_variables,
    torch_header_shim,
    with_torch_headers_of,
    write_subset_ninja,
)
from pipeline.compile.broker import BuildBroker
from pipeline.compile.flash_attn import load_profile, nvcc_release, source_version
from pipeline.memory import parse_size, step_parent
from pipeline.run.executor import Launch
from pipeline.run.ledger import Ledger
from pipeline.run.local import LocalExecutor

DEFAULT_FILES = [
    "flash_bwd_hdim128_bf16_sm80.cu",
    "flash_bwd_hdim64_bf16_sm80.cu",
    "flash_fwd_hdim128_bf16_sm80.cu",
    "flash_fwd_split_hdim128_bf16_sm80.cu",
]
CUDA_HOME = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda-13.0"))


def run_fixed(max_jobs: int, budget: int, work: Path, **ninja_args) -> dict:
    build = work / f"fixed-{max_jobs}"
    write_subset_ninja(build, str(CUDA_HOME / "bin" / "nvcc"), **ninja_args)
    started = time.time()
    attempt = LocalExecutor(parent=step_parent()).start(
        Launch(
            run_id="bench",
            step=f"ninja-j{max_jobs}-{work.name}",
            attempt=1,
            argv=["ninja", "-j", str(max_jobs)],
            cwd=build,
            env={"PATH": os.environ["PATH"]},
            limit_bytes=budget,
            stdout_path=work / f"fixed-{max_jobs}.out",
            stderr_path=work / f"fixed-{max_jobs}.err",
        )
    )
    outcome = attempt.wait()
    return {
        "strategy": f"MAX_JOBS={max_jobs}",
        "oom_kills": outcome.oom_kills,
        "completed": outcome.exit_code == 0,
        "wall_s": round(time.time() - started, 1),
        "peak_bytes": outcome.peak_bytes,
    }


def run_scheduler(
    budget: int, cpus: int, work: Path, run_dir: Path, archs: tuple[str, ...], threads: int, **ninja_args
) -> dict:
    build = work / "scheduler"
    profile = load_profile(archs, threads)
    started = time.time()
    nvcc = CUDA_HOME / "bin" / "nvcc"
    with BuildBroker(
        nvcc=str(nvcc),
        nvcc_version=nvcc_release(nvcc).release,
        package=f"flash-attn {source_version(ninja_args['source'])}",
        profile=profile,
        budget=budget,
        cpu_slots=cpus,
        run_dir=run_dir,
    ) as broker:
        write_subset_ninja(build, broker.env()["PYTORCH_NVCC"], **ninja_args)
        jobs = str(len(ninja_args["files"]))
        done = subprocess.run(
            ["ninja", "-j", jobs],
            cwd=build,
            env={**os.environ, **broker.env()},
            capture_output=True,
            text=True,
        )
        run_id = broker.run_id
    report = broker.report()
    ledger = Ledger(run_dir, create=False)
    try:
        held = ledger.reservations()
        attempts = [a for a in ledger.attempts() if a.run_id == run_id]
    finally:
        ledger.close()
    return {
        "strategy": "eyrie scheduler",
        "oom_kills": report.oom_kills,
        "completed": done.returncode == 0,
        "wall_s": round(time.time() - started, 1),
        "peak_reserved": report.peak_reserved,
        "run_id": run_id,
        "shrunk": sum(len(held.get(a.id, [])) > 1 for a in attempts),
        "jobs": {
            j.name: {
                "anon_peak": j.anon_peak,
                "wall_s": round(j.wall_s or 0, 1),
                "verdicts": j.verdicts,
                "reservations": j.reservations,
            }
            for j in report.jobs
        },
        "reservations": {a.step: held.get(a.id, []) for a in attempts},
    }


def _load() -> list[str]:
    """The host's load averages (1, 5, 15 min): others share this machine."""
    with open("/proc/loadavg", encoding="ascii") as fh:
        return fh.read().split()[:3]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--files", default=",".join(DEFAULT_FILES))
    parser.add_argument("--budget", default="11.75GiB")
    parser.add_argument("--max-jobs", default="2,1", help='fixed MAX_JOBS values in order ("": none)')
    parser.add_argument("--arch", default="120", help="FLASH_ATTN_CUDA_ARCHS, e.g. '100;120'")
    parser.add_argument("--threads", type=int, default=1, help="NVCC_THREADS")
    parser.add_argument("--python", default=sys.executable, help="a Python with a CUDA build of torch")
    parser.add_argument("--headers-python", default=None, help="a Python whose torch headers to compile with")
    parser.add_argument("--cxx-standard", default=None, help="replaces setup.py's -std=c++17 (e.g. c++20)")
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=Path("/var/tmp/eyrie-bench-subset-run"),
        help="the scheduler's ledger (eyrie status --run-dir)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/build_flash_attn_subset.json"))
    args = parser.parse_args()
    budget = parse_size(args.budget)
    files = args.files.split(",")
    cpus = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="eyrie-bench-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        variables = setup_ninja_variables(
            args.source.resolve(), args.python, CUDA_HOME, args.arch, args.threads, work
        )
        headers = args.headers_python or args.python
        variables = with_torch_headers_of(variables, args.python, headers)
        if args.cxx_standard:
            raised = f"-std={args.cxx_standard}"
            variables = {k: v.replace("-std=c++17", raised) for k, v in variables.items()}
        ninja_args = {
            "variables": variables,
            "source": args.source.resolve(),
            "files": files,
            "extra_include": torch_header_shim(headers, work),
        }
        archs = tuple(a for a in args.arch.split(";") if a)
        results = [run_scheduler(budget, cpus, work, args.run_dir, archs, args.threads, **ninja_args)]
        results[-1]["load_after"] = _load()
        print(json.dumps(results[-1]), flush=True)
        for max_jobs in [int(j) for j in args.max_jobs.split(",") if j]:
            results.append(run_fixed(max_jobs, budget, work, **ninja_args))
            results[-1]["load_after"] = _load()
            print(json.dumps(results[-1]), flush=True)
        flags = shlex.split(variables["cuda_post_cflags"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    nvcc = nvcc_release(CUDA_HOME / "bin" / "nvcc").full
    args.out.write_text(
        json.dumps(
            {
                "files": files,
                "budget": budget,
                "cpus": cpus,
                "arch": args.arch,
                "threads": args.threads,
                "nvcc": nvcc,
                "nvcc_flags": flags,
                "results": results,
            },
            indent=1,
        )
        + "\n"
    )
    print("| strategy | OOM kills | completed | wall |\n|---|---|---|---|")
    for r in results:
        print(
            f"| {r['strategy']} | {r['oom_kills']} | {'yes' if r['completed'] else 'no'} | "
            f"{r['wall_s'] / 60:.1f} min |"
        )


if __name__ == "__main__":
    main()
