"""``eyrie build flash-attn``: the command behind the CLI entry and the Dockerfile's builder stage."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from pipeline.compile.flash_attn import (
    DEFAULT_HEADROOM,
    DEFAULT_JOB_PEAK_PER_ARCH,
    FLASH_ATTN_VERSION,
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
from pipeline.memory import format_size

build_app = typer.Typer(
    help="Build compiled dependencies under a memory budget.", no_args_is_help=True, add_completion=False
)


@build_app.command("flash-attn")
def build_flash_attn(
    version: Annotated[
        str, typer.Option(help="flash-attn release to fetch from PyPI (sdist).")
    ] = FLASH_ATTN_VERSION,
    source: Annotated[Path | None, typer.Option(help="An unpacked flash-attn source tree.")] = None,
    archs: Annotated[str, typer.Option(help="'auto' (this host's GPUs) or e.g. '100;120'.")] = "auto",
    budget: Annotated[
        str,
        typer.Option(
            metavar="auto|SIZE",
            help="'auto' (cgroup-aware, less headroom) or a size up to what this process has.",
        ),
    ] = "auto",
    threads: Annotated[
        str, typer.Option(metavar="auto|N", help="nvcc --threads: 'auto' ($NVCC_THREADS if set), or N.")
    ] = "auto",
    out_dir: Annotated[Path, typer.Option(help="Wheel cache (and sources) directory.")] = Path(
        ".eyrie/wheels"
    ),
    run_dir: Annotated[Path | None, typer.Option(help="Ledger of the compile jobs.")] = None,
    python: Annotated[str | None, typer.Option(help="Python whose torch to build against.")] = None,
    cuda_home: Annotated[str | None, typer.Option(help="CUDA toolkit root (default $CUDA_HOME).")] = None,
    headroom: Annotated[str, typer.Option(metavar="SIZE", help="Kept out of an auto budget.")] = format_size(
        DEFAULT_HEADROOM
    ),
    cpus: Annotated[
        int | None, typer.Option(help="CPU slots (default: this process's CPUs; $MAX_JOBS caps the jobs).")
    ] = None,
    profile: Annotated[
        list[Path] | None, typer.Option(help="Extra measured profile JSON (repeatable).")
    ] = None,
) -> None:
    """Build a flash-attn wheel: nvcc jobs admitted by measured peak, each in its own cgroup."""
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
        # Probed after the options are checked: it runs nvcc and imports torch (seconds).
        tools = toolchain(python or sys.executable, cuda_home)
        src = source.resolve() if source else fetch_sdist(version, out_dir / "src", tools.python)
        plan = Plan(source_version(src), src, arch_set, nvcc_threads, budget_bytes, basis, tools, cpu_slots)
        hit = cached_wheel(out_dir, plan.cache_key)
        if hit is not None:
            console.print(f"cached wheel for {plan.cache_key}: {hit}")
            print(hit)
            raise typer.Exit(0)
        measured = load_profile(arch_set, nvcc_threads, profile or [])
        notes = [f"note: {note}" for note in notes]

        def log(text: str) -> None:
            # The options' notes once the build begins: a budget the build refuses is its error alone.
            while notes:
                console.print(notes.pop(0), highlight=False, soft_wrap=True)
            console.print(text, highlight=False)

        wheel, report = run_build(
            plan, out=out_dir, run_dir=run_dir or out_dir / "runs" / plan.cache_key, profile=measured, log=log
        )
    except BuildError as exc:
        err.print(f"[red]error:[/] {exc}", highlight=False, soft_wrap=True)  # one line, whatever the width
        raise typer.Exit(1) from None
    console.print(
        f"built {wheel.name}: {len(report.jobs)} nvcc jobs, {report.oom_kills} OOM kill(s), "
        f"peak reserved {format_size(report.peak_reserved, 'GiB')} of {format_size(report.budget, 'GiB')}"
    )
    print(wheel)
