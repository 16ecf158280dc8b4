"""``eyrie status`` and ``eyrie explain``: the ledger, read for people and for scripts."""

from __future__ import annotations

import json
import signal as signals
import sqlite3
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pipeline.memory import format_duration, format_size
from pipeline.report.neighbours import neighbours
from pipeline.report.timeline import clock
from pipeline.run.layout import attempt_logs
from pipeline.run.ledger import LEDGER_NAME, AttemptRow, Ledger, StepState
from pipeline.run.step_contract import EXIT_BAD_INPUT, MANIFEST_NAME, read_manifest
from pipeline.run.verdict import meaningful

# Steps that have no attempt in the run to show: listed below the attempts with their state.
NOT_RUN_STATES = (StepState.SKIPPED, StepState.BLOCKED, StepState.PENDING, StepState.CANCELLED)
VERDICT_STYLE = {
    "succeeded": "green",
    "completed_then_crashed": "yellow",
    "oom_killed": "bold red",
    "child_oom_killed": "red",
    "memory_error": "red",
    "crashed": "red",
    "failed": "red",
    "timed_out": "magenta",
    "cancelled": "yellow",
    "preempted": "yellow",
    "node_failed": "yellow",
}

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


def open_ledger(run_dir: Path, err: Console) -> Ledger | None:
    """The ledger of ``run_dir``, read only; None, said in one line on ``err``, when it cannot be read."""
    try:
        return Ledger(run_dir, create=False)
    except FileNotFoundError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
    except sqlite3.Error as exc:
        unreadable(Path(run_dir) / LEDGER_NAME, exc, err)
    return None


def resolve_run_dir(run_dir: Path | None, runs: Path, err: Console) -> Path | None:
    """``run_dir`` when given; else the folder under ``runs`` whose ledger's latest run started last,
    named on ``err``. None, said in one line, when there is none."""
    if run_dir is not None:
        return run_dir
    newest: tuple[float, Path] | None = None
    for path in sorted(runs.glob(f"*/{LEDGER_NAME}")):
        try:
            ledger = Ledger(path.parent, create=False)
            try:
                latest = ledger.latest_run()
            finally:
                ledger.close()
        except sqlite3.Error:
            continue  # not a ledger this can read: the others may still be
        if latest and (newest is None or latest["started_at"] > newest[0]):
            newest = (latest["started_at"], path.parent)
    if newest is None:
        err.print(
            f"[red]error:[/] no run under {escape(str(runs))}/: run a pipeline first (`eyrie run FILE`), "
            "or pass --run-dir",
            highlight=False,
            soft_wrap=True,
        )
        return None
    err.print(
        f"eyrie: the most recent run is in {escape(str(newest[1]))} (pass --run-dir for another)",
        highlight=False,
        soft_wrap=True,
    )
    return newest[1]


def unreadable(path: Path, exc: sqlite3.Error, err: Console) -> int:
    """One line for a ledger SQLite cannot read; the exit code of a command that needed it."""
    err.print(
        f"[red]error:[/] cannot read the ledger {escape(str(path))}: {escape(str(exc))} "
        "(check that it is an eyrie ledger you may read, or pass the right --run-dir)",
        highlight=False,
        soft_wrap=True,
    )
    return EXIT_BAD_INPUT


def exit_text(row: AttemptRow) -> str:
    if row.signal is not None:
        try:
            return signals.Signals(row.signal).name
        except ValueError:
            return f"signal {row.signal}"
    return "-" if row.exit_code is None else str(row.exit_code)


def wide_console() -> Console:
    """A console that does not squeeze tables to 80 columns when output is piped or logged."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


def status_command(
    run_dir: Path | None, runs: Path, json_output: bool, follow: bool, history: bool = False
) -> int:
    console, err = wide_console(), Console(stderr=True)
    if follow and history:
        err.print(
            "[red]error:[/] status: --all and --follow do not go together (--all shows every run's "
            "attempts, --follow the latest run live); pass one of them",
            highlight=False,
            soft_wrap=True,
        )
        return EXIT_BAD_INPUT
    run_dir = resolve_run_dir(run_dir, runs, err)
    if run_dir is None:
        return EXIT_BAD_INPUT
    if follow:
        from pipeline.report.follow import follow_command

        return follow_command(run_dir, json_output)
    ledger = open_ledger(run_dir, err)
    if ledger is None:
        return EXIT_BAD_INPUT
    try:
        return _status(ledger, console, json_output, history)
    except sqlite3.Error as exc:
        return unreadable(ledger.path, exc, err)
    finally:
        ledger.close()


def not_run_steps(ledger: Ledger, run: dict) -> dict[str, dict]:
    """The steps of ``run`` that have no attempt in it (skipped, blocked, cancelled before they
    started, not started yet), in the pipeline's order: their state rows."""
    ran = {row.step for row in ledger.attempts() if row.run_id == run["run_id"]}
    states = ledger.step_states(run["run_id"])
    return {
        step: states[step]
        for step in json.loads(run["steps"])
        if step in states and step not in ran and states[step]["state"] in NOT_RUN_STATES
    }


def not_run_reason(state: dict) -> str:
    """Why a step did not run, as a sentence: ``after did not run: writer ended crashed``."""
    if state["state"] == StepState.PENDING:
        return f"{state['step']} has not run yet"
    detail = state["detail"]
    for said in ("not run: ", "cancelled: "):  # the state's own word, said again by the sentence
        detail = detail.removeprefix(said)
    return f"{state['step']} did not run: {detail or state['state']}"


def _status(ledger: Ledger, console: Console, json_output: bool, history: bool) -> int:
    every = ledger.attempts()
    latest = ledger.latest_run()
    reservations = ledger.reservations()
    if json_output:
        rows = [a.as_json() | ({"reservations": reservations[a.id]} if a.id in reservations else {})
                for a in every]  # fmt: skip
        print(json.dumps(rows, indent=2))
        return 0
    title = "eyrie status"
    attempts, not_run = every, {}
    if latest:
        title += f" — run {latest['run_id']} {latest['state']} ({escape(latest['pipeline'])})"
        not_run = not_run_steps(ledger, latest)
        if not history:
            attempts = [a for a in every if a.run_id == latest["run_id"]]
    if reservations:  # a build: its compile jobs, each reserved by a prediction
        console.print(_build_table(title, attempts, reservations))
        return 0
    table = Table(title=title, title_justify="left")
    for column, justify in [
        ("step", "left"), ("attempt", "right"), ("verdict", "left"), ("exit", "right"),
        ("peak / limit", "right"), ("OOM kills", "right"), ("duration", "right"),
        ("records", "right"), ("started", "right"), ("reason", "left"),
    ]:  # fmt: skip
        table.add_column(column, justify=justify, no_wrap=column != "reason")
    shown: list[AttemptRow | dict] = list(attempts)
    if history:  # the history, then the latest run's steps that did not run
        shown += not_run.values()
    elif latest:  # each step where the pipeline lists it: its attempts in this run, or its state
        steps = json.loads(latest["steps"])
        states = ledger.step_states(latest["run_id"])
        shown = []
        for step in steps:
            if step in not_run:
                shown.append(not_run[step])
            elif ran := [a for a in attempts if a.step == step]:
                shown += ran
            elif step in states:  # an attempt of an earlier run, waited for by this one (a Slurm job)
                shown += [a for a in every if a.step == step][-1:]
        shown += [a for a in attempts if a.step not in steps]
    for item in shown:
        if isinstance(item, dict):
            table.add_row(item["step"], "-", f"[dim]{item['state']}[/]", "", "", "", "", "", "",
                          f"[dim]{escape(item['detail'])}[/]")  # fmt: skip
            continue
        verdict = item.verdict or f"running ({f'pid {item.pid}' if item.pid else item.location})"
        style = VERDICT_STYLE.get(item.verdict or "", "cyan")
        table.add_row(
            item.step,
            str(item.attempt),
            f"[{style}]{verdict}[/]",
            exit_text(item),
            f"{format_size(item.peak_bytes)} / {format_size(item.limit_bytes)}",
            "-" if item.oom_kills is None else str(item.oom_kills),
            format_duration(item.wall_s),
            "-" if item.records is None else f"{item.records:,}",
            clock(item.started_at),
            escape(item.reason or ""),
        )
    console.print(table)
    return 0


def _build_table(title: str, attempts: list[AttemptRow], reservations: dict[int, list[dict]]) -> Table:
    """Each compile job's predicted peak beside its measured one, and what it held of the budget."""
    table = Table(title=title, title_justify="left")
    for column, justify in [
        ("job", "left"), ("attempt", "right"), ("verdict", "left"), ("predicted peak", "right"),
        ("measured peak", "right"), ("measured / predicted", "right"), ("reserved", "right"),
        ("duration", "right"), ("prediction", "left"),
    ]:  # fmt: skip
        table.add_column(column, justify=justify, no_wrap=column != "prediction")
    for row in attempts:
        held = reservations.get(row.id, [])
        expected = held[0]["expected_bytes"] if held else None
        ratio = f"{row.anon_peak_bytes / expected:.2f}" if expected and row.anon_peak_bytes else "-"
        reserved = " → ".join(format_size(r["reserved_bytes"]) for r in held) or format_size(row.limit_bytes)
        style = VERDICT_STYLE.get(row.verdict or "", "cyan")
        table.add_row(
            row.step, str(row.attempt), f"[{style}]{row.verdict or f'running (pid {row.pid})'}[/]",
            format_size(expected) if expected else "default", format_size(row.anon_peak_bytes), ratio,
            reserved, format_duration(row.wall_s), escape(row.limit_reason or ""),
        )  # fmt: skip
    return table


def explain(row: AttemptRow, run_dir: Path) -> list[str]:
    """Plain sentences saying why an attempt ended as it did, and the facts behind it, from the
    ledger (and the step's folder, for outputs written without a manifest)."""
    verdict = row.verdict
    if verdict is None:
        where = f"pid {row.pid}, {row.location}" if row.pid else row.location  # a Slurm job has no pid here
        return [f"{row.step} attempt {row.attempt} is still running ({where})."]
    lines = [f"{HEADLINE.get(verdict, verdict)}: {row.reason}."]
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
        f"{' '.join(outputs)}` (from Python, pipeline.run.step_contract.write_manifest); a crash after that "
        "is completed_then_crashed, and the outputs are kept.",
    ]


def explain_command(run_dir: Path | None, runs: Path, step: str, attempt: int | None) -> int:
    console, err = wide_console(), Console(stderr=True)
    run_dir = resolve_run_dir(run_dir, runs, err)
    if run_dir is None:
        return EXIT_BAD_INPUT
    ledger = open_ledger(run_dir, err)
    if ledger is None:
        return EXIT_BAD_INPUT
    try:
        return _explain(ledger, run_dir, step, attempt, console, err)
    except sqlite3.Error as exc:
        return unreadable(ledger.path, exc, err)
    finally:
        ledger.close()


def _explain(ledger: Ledger, run_dir: Path, step: str, attempt: int | None, console: Console,
             err: Console) -> int:  # fmt: skip
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
        rows = [r for r in rows if r.attempt == attempt]
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
    for line in explain(row, run_dir) + neighbours(ledger, row):
        console.print(escape(line), highlight=False, soft_wrap=True)
    return 0
