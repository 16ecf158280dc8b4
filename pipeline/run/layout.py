"""Where a run directory keeps the runner's own files, beside the steps' folders: under ``.eyrie/``
(``STATE_DIR``, which the step contract names: a step finds its services' URLs there)."""

from __future__ import annotations

from pathlib import Path

from pipeline.contract.step import STATE_DIR

REPORT_NAME = "report.html"
"""What ``eyrie report`` writes in the run directory unless told otherwise."""


def attempt_name(run_id: str, step: str, attempt: int) -> str:
    """What an attempt is called where an engine names it (a container, a Slurm job): unique per
    run, step and attempt, so a rerun finds what an earlier runner left by its name."""
    return f"eyrie-{run_id}-{step}-{attempt}"


def attempt_logs(run_dir: Path, step: str, attempt: int) -> tuple[Path, Path]:
    """The files an attempt's stdout and stderr are kept in."""
    logs = Path(run_dir) / STATE_DIR / "logs" / step
    return logs / f"attempt-{attempt}.stdout.log", logs / f"attempt-{attempt}.stderr.log"
