"""Measure flash-attn compile-job profiles with a given nvcc: what ``pipeline/compile/profiles/`` ships.

Every chosen .cu file of a flash-attn source tree is compiled with the flags its
real setup.py gives torch's ninja file, through the build broker (each job in a
cgroup of its own under a build cgroup limited to ``--budget``, admitted by the
prediction the shipped profiles give), and every finished job's anonymous peak,
wall time and memory shape are written to ``--out`` as soon as it ends, so a
measurement cut short keeps what it measured. ninja offers every file at once,
so the broker chooses which jobs run side by side.

Run (about 72 × 2 min of compile for one arch on 2 cores):
  .venv/bin/python -m benchmarks.build_measure_profiles --source DIR --python CUDA_TORCH_PY \
      --cuda-home NVCC_ROOT [--archs 120] [--threads 1] [--budget 14GiB] [--cpus 2] \
      [--cxx-standard c++20] [--files a.cu,b.cu] --out PROFILE.json
NVCC_ROOT is a CUDA toolkit root, e.g. /usr/local/cuda-13.0, or the ``nvidia/cu13``
folder of PyPI's ``nvidia-cuda-nvcc``, ``nvidia-cuda-crt``, ``nvidia-nvvm`` and
``nvidia-cuda-runtime`` wheels of one release installed with ``pip install --target``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from benchmarks.compile_subset import setup_ninja_variables, write_subset_ninja
from pipeline.compile.broker import BuildBroker
from pipeline.compile.flash_attn import cuda_sources, load_profile, nvcc_release, source_version
from pipeline.compile.profile import JobKey, Profile, ProfileEntry, shape_of
from pipeline.memory import parse_size
from pipeline.run.ledger import Ledger


def measured_entries(run_dir: Path, run_ids: set[str], key_of: Callable[[str], JobKey]) -> list[ProfileEntry]:
    """Every job of these runs that succeeded, as a profile entry (read back from the ledger)."""
    ledger = Ledger(run_dir, create=False)
    try:
        entries = []
        for row in ledger.attempts():
            if row.run_id not in run_ids or row.verdict != "succeeded" or not row.anon_peak_bytes:
                continue
            key = key_of(row.step)
            entries.append(
                ProfileEntry(
                    key.source,
                    list(key.archs),
                    key.threads,
                    key.nvcc,
                    row.anon_peak_bytes,
                    round(row.wall_s, 2),
                    key.package,
                    shape=shape_of(ledger.timeline(row.id)),
                )
            )
        return entries
    finally:
        ledger.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--python", required=True, help="a Python with a CUDA build of torch")
    parser.add_argument("--cuda-home", type=Path, required=True)
    parser.add_argument("--archs", default="120")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budget", default="14GiB")
    parser.add_argument("--cpus", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--cxx-standard", default="c++20", help="replaces setup.py's -std=c++17")
    parser.add_argument("--files", default="", help="comma-separated .cu names (default: every one)")
    parser.add_argument("--run-dir", type=Path, default=Path("/var/tmp/eyrie-measure-profiles"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    source = args.source.resolve()
    version = source_version(source)
    nvcc = nvcc_release(args.cuda_home / "bin" / "nvcc")
    archs = tuple(a for a in args.archs.replace(",", ";").split(";") if a)
    files = args.files.split(",") if args.files else cuda_sources(source)

    def key_of(name: str) -> JobKey:
        return JobKey(name, archs, args.threads, nvcc.release, f"flash-attn {version}")

    profile = load_profile(archs, args.threads)
    with tempfile.TemporaryDirectory(prefix="eyrie-measure-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        variables = setup_ninja_variables(
            source, args.python, args.cuda_home, ";".join(archs), args.threads, work
        )
        raised = f"-std={args.cxx_standard}"
        variables = {k: v.replace("-std=c++17", raised) for k, v in variables.items()}
        with BuildBroker(
            nvcc=str(args.cuda_home / "bin" / "nvcc"),
            nvcc_version=nvcc.release,
            package=f"flash-attn {version}",
            profile=profile,
            budget=parse_size(args.budget),
            cpu_slots=args.cpus,
            run_dir=args.run_dir,
        ) as broker:
            write_subset_ninja(work / "build", broker.env()["PYTORCH_NVCC"], variables, source, files)
            ninja = subprocess.Popen(
                ["ninja", "-k", "0", "-j", str(len(files))],
                cwd=work / "build",
                env={**os.environ, **broker.env()},
            )
            stop = threading.Event()

            def save() -> None:
                note = (
                    f"flash-attn {version}, nvcc {nvcc.full}, sm {';'.join(archs)}, --threads "
                    f"{args.threads}, the flags of its setup.py with {raised}, measured by "
                    f"benchmarks/build_measure_profiles.py (run {broker.run_id}), each job in its own "
                    f"cgroup, {args.cpus} at most at once"
                )
                measured = Profile(measured_entries(args.run_dir, {broker.run_id}, key_of), default_peak=1)
                measured.save(args.out, note=note)

            def save_every_minute() -> None:
                while not stop.wait(60):
                    save()

            saver = threading.Thread(target=save_every_minute, daemon=True)
            saver.start()
            ninja.wait()
            stop.set()
            saver.join()
        save()
    measured = len(measured_entries(args.run_dir, {broker.run_id}, key_of))
    print(f"{measured} of {len(files)} jobs measured: {args.out}")
    sys.exit(ninja.returncode)


if __name__ == "__main__":
    main()
