"""``eyrie status``: the ledger's attempts, read for people and for scripts."""

from __future__ import annotations

import json
import signal as signals
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pipeline.memory import format_duration, format_size
from pipeline.report.console import VERDICT_STYLE, wide_console
from pipeline.report.follow import gone_note
from pipeline.report.ledger_access import read_run
from pipeline.report.timeline import clock
from pipeline.run.ledger import AttemptRow, Ledger, StepState

# Steps that have no attempt in the run to show: listed below the attempts with their state.
NOT_RUN_STATES = (StepState.SKIPPED, StepState.BLOCKED, StepState.PENDING, StepState.CANCELLED)


def exit_text(row: AttemptRow) -> str:
    if row.signal is not None:
        try:
            return signals.Signals(row.signal).name
        except ValueError:
            return f"signal {row.signal}"
    return "-" if row.exit_code is None else str(row.exit_code)


def status_command(run_dir: Path | None, runs: Path, json_output: bool, history: bool = False) -> int:
    """`eyrie status` (`--follow` is ``follow.follow_command``'s, which cli.py calls itself)."""
    console, err = wide_console(), Console(stderr=True)

    def read(ledger: Ledger, _: Path) -> int:
        return _print_status(ledger, console, json_output, history)

    return read_run(run_dir, runs, err, read)


def not_run_steps(ledger: Ledger, run: dict) -> dict[str, dict]:
    """The steps of ``run`` that have no attempt in it (skipped, blocked, cancelled before they
    started, not started yet), in the pipeline's order: their state rows."""
    ran = {row.step for row in ledger.attempts_of(run["run_id"])}
    states = ledger.step_states(run["run_id"])
    return {
        step: states[step]
        for step in json.loads(run["steps"])
        if step in states and step not in ran and states[step]["state"] in NOT_RUN_STATES
    }


COLUMNS = [
    ("step", "left"),
    ("attempt", "right"),
    ("verdict", "left"),
    ("exit", "right"),
    ("peak / limit", "right"),
    ("OOM kills", "right"),
    ("duration", "right"),
    ("records", "right"),
    ("started", "right"),
    ("reason", "left"),
]
"""The status table's columns and how each is justified."""


def _print_status(ledger: Ledger, console: Console, json_output: bool, history: bool) -> int:
    every = ledger.attempts()
    latest = ledger.latest_run()
    reservations = ledger.reservations()
    if json_output:
        rows = [
            a.as_json() | ({"reservations": reservations[a.id]} if a.id in reservations else {})
            for a in every
        ]
        print(json.dumps(rows, indent=2))
        return 0
    title = "eyrie status"
    attempts, not_run = every, {}
    gone = gone_note(ledger, latest) if latest else None
    if latest:
        title += f" — run {latest['run_id']} {latest['state']} ({escape(latest['pipeline'])})"
        not_run = not_run_steps(ledger, latest)
        if not history:
            attempts = [a for a in every if a.run_id == latest["run_id"]]
    if reservations:  # a build: its compile jobs, each reserved by a prediction
        console.print(_build_table(title, attempts, reservations))
        _say_gone(console, gone)
        return 0
    table = Table(title=title, title_justify="left")
    for column, justify in COLUMNS:
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
            blank = [""] * (len(COLUMNS) - 4)  # a step that did not run: no exit, peak, duration
            table.add_row(
                item["step"], "-", f"[dim]{item['state']}[/]", *blank, f"[dim]{escape(item['detail'])}[/]"
            )
            continue
        verdict = item.verdict or f"running ({f'pid {item.pid}' if item.pid else item.location})"
        style = VERDICT_STYLE.get(item.verdict or "", "cyan")
        table.add_row(
            item.label,
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
    _say_gone(console, gone)
    return 0


def _say_gone(console: Console, note: str | None) -> None:
    """Below the table: the runner of a run still held as running is gone (``follow.gone_note``)."""
    if note:
        console.print(f"[yellow]{escape(note)}[/]", highlight=False, soft_wrap=True)


def _build_table(title: str, attempts: list[AttemptRow], reservations: dict[int, list[dict]]) -> Table:
    """Each compile job's predicted peak beside its measured one, and what it held of the budget."""
    table = Table(title=title, title_justify="left")
    for column, justify in [
        ("job", "left"),
        ("attempt", "right"),
        ("verdict", "left"),
        ("predicted peak", "right"),
        ("measured peak", "right"),
        ("measured / predicted", "right"),
        ("reserved", "right"),
        ("duration", "right"),
        ("prediction", "left"),
    ]:
        table.add_column(column, justify=justify, no_wrap=column != "prediction")
    for row in attempts:
        held = reservations.get(row.id, [])
        expected = held[0]["expected_bytes"] if held else None
        ratio = f"{row.anon_peak_bytes / expected:.2f}" if expected and row.anon_peak_bytes else "-"
        reserved = " → ".join(format_size(r["reserved_bytes"]) for r in held) or format_size(row.limit_bytes)
        style = VERDICT_STYLE.get(row.verdict or "", "cyan")
        table.add_row(
            row.step,
            str(row.attempt),
            f"[{style}]{row.verdict or f'running (pid {row.pid})'}[/]",
            format_size(expected) if expected else "default",
            format_size(row.anon_peak_bytes),
            ratio,
            reserved,
            format_duration(row.wall_s),
            escape(row.limit_reason or ""),
        )
    return table
