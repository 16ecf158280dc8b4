"""``eyrie explain``: why a step's attempt ended as it did, or why the step did not run, in plain
sentences with the evidence (the report's explanations are these, too)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from pipeline.contract.exits import EXIT_BAD_INPUT
from pipeline.contract.step import MANIFEST_NAME, read_manifest
from pipeline.memory import format_duration, format_size
from pipeline.report.console import wide_console
from pipeline.report.follow import gone_note
from pipeline.report.ledger_access import read_run
from pipeline.report.neighbours import neighbours
from pipeline.report.status import exit_text, not_run_steps
from pipeline.report.timeline import clock
from pipeline.run.layout import attempt_logs
from pipeline.run.ledger import AttemptRow, Ledger, StepState
from pipeline.run.verdict import meaningful

HEADLINE = {
    "succeeded": "Succeeded",
    "oom_killed": "OOM-killed",
    "child_oom_killed": "A child process was OOM-killed",
    "completed_then_crashed": "Completed, then crashed",
    "memory_error": "Ran out of memory without an OOM kill",
    "crashed": "Crashed",
    "failed": "Failed",
    "timed_out": "Timed out",
    "cancelled": "Cancelled",
    "preempted": "Preempted",
    "node_failed": "Its node failed",
}


def not_run_reason(state: dict) -> str:
    """Why a step did not run, as a sentence: ``after did not run: writer ended crashed``."""
    if state["state"] == StepState.PENDING:
        return f"{state['step']} has not run yet"
    detail = state["detail"]
    for said in ("not run: ", "cancelled: "):  # the state's own word, said again by the sentence
        detail = detail.removeprefix(said)
    return f"{state['step']} did not run: {detail or state['state']}"


def attempt_account(row: AttemptRow, run_dir: Path) -> list[str]:
    """Plain sentences saying why an attempt ended as it did, and the facts behind it, from the
    ledger (and the step's folder, for outputs written without a manifest)."""
    verdict = row.verdict
    if verdict is None:
        where = f"pid {row.pid}, {row.location}" if row.pid else row.location  # a Slurm job has no pid here
        return [f"{row.step} attempt {row.attempt} is still running ({where})."]
    lines = [f"{HEADLINE.get(verdict, verdict)}: {row.reason}."]
    if run_reason := row.data.get("run_reason"):
        lines.append(f"It ran because {run_reason}.")
    if row.oom_kills:
        lines.append(
            f"oom_kill went {row.oom_kills_before}→{row.oom_kills_after} in the step's cgroup"
            + (f" at {clock(row.oom_at)}" if row.oom_at else "")
            + "."
        )
    peak = f"peak {format_size(row.peak_bytes)} of {format_size(row.limit_bytes)} limit"
    if row.anon_peak_bytes:
        peak += f" (anonymous memory peak {format_size(row.anon_peak_bytes)})"
    lines.append(peak + ".")
    if row.limit_reason:
        lines.append(f"Its limit was set so because: {row.limit_reason}.")
    lines.append(
        f"Ran {format_duration(row.wall_s)} from {clock(row.started_at)} to {clock(row.ended_at)}, "
        f"exit {exit_text(row)}, {row.executor} executor at {row.location or '-'}"
        + (
            f"; host had {format_size(row.host_mem_available)} available of "
            f"{format_size(row.host_mem_total)} at start."
            if row.host_mem_total  # none where the step ran on a node the runner does not see
            else "."
        )
    )
    tail = [t for t in json.loads(row.stderr_tail or "[]") if meaningful(t)][-5:]
    if tail and verdict != "succeeded":
        lines.append("Last lines of stderr:")
        lines.extend(f"    {t}" for t in tail)
    if verdict in ("crashed", "failed") and row.outputs:
        lines += _outputs_without_manifest(row, Path(run_dir), row.outputs)
    stdout_log, stderr_log = attempt_logs(run_dir, row.step, row.attempt)
    lines.append(f"Logs: {stdout_log} and {stderr_log.name}")
    return lines


def _outputs_without_manifest(row: AttemptRow, run_dir: Path, outputs: list[str]) -> list[str]:
    """When every output the step declared (as the attempt recorded them) was written during this
    attempt but no manifest says they are complete: their sizes and last writes, and how a plain
    command declares completion."""
    step_dir = run_dir / row.step
    if read_manifest(step_dir) is not None:
        return []
    facts = []
    for name in outputs:
        path = step_dir / name
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        if not files:
            return []
        written = max(f.stat().st_mtime for f in files)
        # file times come from the kernel's coarse clock, up to a tick behind the attempt's times
        if not row.started_at - 1 <= written <= (row.ended_at or time.time()) + 1:
            return []  # written by another attempt
        size = sum(f.stat().st_size for f in files)
        facts.append(f"{name} ({format_size(size)}, last written {clock(written)})")
    return [
        f"Every declared output was written during this attempt, but no {MANIFEST_NAME} says they are "
        f"complete: {', '.join(facts)}.",
        f"If the command had finished them, it can declare it before it exits: `eyrie manifest "
        f"{' '.join(outputs)}` (from Python, pipeline.contract.step.write_manifest); a crash after that "
        "is completed_then_crashed, and the outputs are kept.",
    ]


def explain_command(run_dir: Path | None, runs: Path, step: str, attempt: int | None) -> int:
    console, err = wide_console(), Console(stderr=True)

    def read(ledger: Ledger, found: Path) -> int:
        return _print_step_account(ledger, found, step, attempt, console, err)

    return read_run(run_dir, runs, err, read)


def _print_step_account(
    ledger: Ledger, run_dir: Path, step: str, attempt: int | None, console: Console, err: Console
) -> int:
    rows = ledger.attempts(step)
    latest = ledger.latest_run()
    not_run = not_run_steps(ledger, latest).get(step) if latest and attempt is None else None
    if not_run is not None:  # the latest run did not run it: say why, then what its last attempt was
        console.print(f"[bold]{escape(step)}[/], run {escape(latest['run_id'])}", highlight=False)
        console.print(
            escape(f"{not_run['state'].capitalize()}: {not_run_reason(not_run)}."),
            highlight=False,
            soft_wrap=True,
        )
        if not rows:
            return 0
        console.print(f"Its last attempt was in an earlier run, {escape(rows[-1].run_id)}:", highlight=False)
    if attempt is not None:
        numbers = sorted({r.attempt for r in rows})
        rows = [r for r in rows if r.attempt == attempt]
        if not rows and numbers:  # the step ran: the attempt number is what is wrong
            err.print(
                f"[red]error:[/] no attempt {attempt} of step {escape(repr(step))} in {run_dir}; "
                f"its attempts: {', '.join(map(str, numbers))}",
                highlight=False,
                soft_wrap=True,
            )
            return EXIT_BAD_INPUT
    if not rows:
        known = sorted(
            {r.step for r in ledger.attempts()} | set(json.loads(latest["steps"]) if latest else [])
        )
        what = f"attempt {attempt} of step {step!r}" if attempt else f"step {step!r}"
        err.print(
            f"[red]error:[/] no {escape(what)} in {run_dir}; pass one of its steps: "
            f"{escape(', '.join(known) or 'none')}",
            highlight=False,
            soft_wrap=True,
        )
        return EXIT_BAD_INPUT
    row = rows[-1]
    console.print(f"[bold]{escape(row.step)}[/] attempt {row.attempt}", highlight=False)
    lines = attempt_account(row, run_dir) + neighbours(ledger, row)
    if row.verdict is None and (run := ledger.run(row.run_id)) and (gone := gone_note(ledger, run)):
        lines.insert(1, gone[0].upper() + gone[1:] + ".")
    for line in lines:
        console.print(escape(line), highlight=False, soft_wrap=True)
    return 0
