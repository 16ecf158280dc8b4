"""``eyrie build flash-attn``: the command behind the CLI entry and the Dockerfile's builder stage."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rich.console import Console

from pipeline.compile.flash_attn import (
    DEFAULT_JOB_PEAK_PER_ARCH,
    BuildError,
    Plan,
    auto_threads,
    cached_wheel,
    environment_settings,
    fetch_sdist,
    load_profile,
    parse_archs,
    resolve_budget,
    run_build,
    size_option,
    source_version,
    toolchain,
)


def flash_attn_command(*, version: str, source: Path | None, archs: str, budget: str, threads: str,
                       out: Path, run_dir: Path | None, python: str | None, cuda_home: str | None,
                       headroom: str, cpus: int | None, profiles: list[Path]) -> int:  # fmt: skip
    console, err = Console(), Console(stderr=True)
    try:
        arch_set = parse_archs(archs)
        budget_bytes, basis, notes = resolve_budget(budget, size_option("--headroom", headroom))
        threads, max_jobs, from_environment = environment_settings(os.environ, threads)
        notes += from_environment
        cpu_slots = cpus or len(os.sched_getaffinity(0))
        if threads == "auto":
            nvcc_threads = auto_threads(arch_set, budget_bytes, cpu_slots, DEFAULT_JOB_PEAK_PER_ARCH)
        elif threads.isdigit() and int(threads) > 0:
            nvcc_threads = int(threads)
        else:
            raise BuildError(f"--threads {threads!r}: write auto or a positive number")
        if max_jobs is not None:  # a job takes one CPU slot per arch nvcc compiles at once
            cpu_slots = min(cpu_slots, max_jobs * min(nvcc_threads, len(arch_set)))
        for note in notes:
            console.print(f"note: {note}", highlight=False, soft_wrap=True)
        # Probed after the options are checked: it runs nvcc and imports torch (seconds).
        tools = toolchain(python or sys.executable, cuda_home)
        src = source.resolve() if source else fetch_sdist(version, out / "src", tools.python)
        plan = Plan(source_version(src), src, arch_set, nvcc_threads, budget_bytes, basis, tools, cpu_slots)
        hit = cached_wheel(out, plan.cache_key)
        if hit is not None:
            console.print(f"cached wheel for {plan.cache_key}: {hit}")
            print(hit)
            return 0
        profile = load_profile(arch_set, nvcc_threads, profiles)
        wheel, report = run_build(
            plan, out=out, run_dir=run_dir or out / "runs" / plan.cache_key, profile=profile,
            log=lambda text: console.print(text, highlight=False),
        )  # fmt: skip
    except BuildError as exc:
        err.print(f"[red]error:[/] {exc}", highlight=False, soft_wrap=True)  # one line, whatever the width
        return 1
    console.print(
        f"built {wheel.name}: {len(report.jobs)} nvcc jobs, {report.oom_kills} OOM kill(s), "
        f"peak reserved {report.peak_reserved / 2**30:.2f} of {report.budget / 2**30:.2f} GiB"
    )
    print(wheel)
    return 0
