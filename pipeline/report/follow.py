"""``eyrie status --follow``: a run as it goes, from the ledger, the steps' cgroups and their logs.

Nothing here talks to the runner, so it works from any shell that can read the
run directory and, for memory in use, the steps' cgroups: each step's state,
its memory against its limit, its peak, records and elapsed time, the host's
memory and the budget, and the last line each running step printed. It ends
when the run ends, leaving the last view on screen; ``--json`` prints the same
view as one JSON object a line. A runner that is gone (``liveness.runner_gone``: on this host its
pid, elsewhere ``RUNNER_GONE_S`` without a sign of life) ends it, with the note ``status`` and
``explain`` give too (``gone_note``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from pipeline.contract.exits import EXIT_BAD_INPUT, EXIT_INTERRUPTED
from pipeline.memory import cgroup_at, format_duration, format_size
from pipeline.report.console import VERDICT_STYLE, wide_console
from pipeline.report.ledger_access import read_run
from pipeline.report.timeline import clock
from pipeline.run.layout import attempt_logs
from pipeline.run.ledger import Ledger, RunState, StepState
from pipeline.run.liveness import runner_gone
from pipeline.run.verdict import meaningful

REFRESH_S = 1.0
TAIL_BYTES = 8192  # enough of a log's end to hold its last line


@dataclass
class StepView:
    step: str
    state: str
    attempt: int | None = None
    verdict: str | None = None
    usage_bytes: int | None = None
    limit_bytes: int | None = None
    peak_bytes: int | None = None
    records: int | None = None
    elapsed_s: float | None = None
    last_line: str | None = None


@dataclass
class RunView:
    at: float
    run_id: str
    pipeline: str
    state: str
    ended: bool
    budget_bytes: int | None
    reserved_bytes: int
    host: dict[str, int] | None
    host_sampled: bool
    """False when the steps run on machines the runner cannot see (Slurm's nodes)."""
    steps: list[StepView] = field(default_factory=list)
    note: str | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def view(ledger: Ledger, run_dir: Path) -> RunView | None:
    """What the latest run of a ledger is doing now; None when the ledger holds no run."""
    run = ledger.latest_run()
    if run is None:
        return None
    now = time.time()
    run_id = run["run_id"]
    states = ledger.step_states(run_id)
    latest = {row.label: row for row in ledger.attempts_of(run_id)}  # oldest first: the last one stays
    names = json.loads(run["steps"]) or list(latest)  # a build lists its compile jobs as they come
    names += [label for label, row in latest.items() if row.replica is not None]  # services, once started
    reservations = ledger.reservations()
    steps, reserved = [], 0
    for name in names:
        row = latest.get(name)
        state = states.get(name, {}).get("state") or ("running" if row and row.verdict is None else "ended")
        step = StepView(name, state)
        if row is not None:
            step.attempt, step.verdict, step.limit_bytes = row.attempt, row.verdict, row.limit_bytes
            step.peak_bytes, step.records = row.peak_bytes, row.records
            step.elapsed_s = (row.ended_at or now) - row.started_at
            if row.verdict is None:
                cgroup = cgroup_at(row.location) if row.location else None
                if cgroup is not None:
                    try:
                        step.usage_bytes, step.peak_bytes = cgroup.usage(), cgroup.peak()
                    except OSError:
                        pass  # it ended between the listing and the read
                step.last_line = _last_line(*attempt_logs(run_dir, name, row.attempt))
                held = reservations.get(row.id)  # a compile job's, as it changes; else its limit
                reserved += held[-1]["reserved_bytes"] if held else row.limit_bytes
        steps.append(step)
    last = ledger.last_host_sample(run_id)
    host = None
    if last is not None:
        host = {
            "mem_total": last.mem_total,
            "mem_available": last.mem_available,
            "available": last.available,
            "in_use": last.in_use,
        }
    note = gone_note(ledger, run, now)
    ended = run["state"] != RunState.RUNNING or note is not None
    return RunView(
        at=now,
        run_id=run_id,
        pipeline=run["pipeline"],
        state=run["state"],
        ended=ended,
        budget_bytes=run["budget_bytes"],
        reserved_bytes=reserved,
        host=host,
        host_sampled=run.get("host_sampled") != 0,
        steps=steps,
        note=note,
    )


def gone_note(ledger: Ledger, run: dict[str, Any], now: float | None = None) -> str | None:
    """What ``status``, ``explain`` and ``--follow`` say of a run whose runner is gone while the
    ledger holds it as running; None otherwise."""
    now = time.time() if now is None else now
    seen = runner_gone(ledger, run, now)
    if seen is None:
        return None
    return (
        f"the runner (pid {run['orchestrator_pid']} on {run['host']}) is gone since {clock(seen)}, its "
        f"last sign of life {format_duration(now - seen)} ago; the run did not end cleanly: rerun to resume"
    )


def _last_line(*logs: Path) -> str | None:
    """The last meaningful line of whichever log was written last."""
    written = [(p.stat().st_mtime, p) for p in logs if p.is_file()]
    for _, path in sorted(written, reverse=True):
        try:
            with open(path, "rb") as fh:
                fh.seek(max(0, path.stat().st_size - TAIL_BYTES))
                lines = fh.read().decode("utf-8", errors="replace").splitlines()
        except OSError:
            continue  # removed meanwhile
        text = next((t for line in reversed(lines) if (t := meaningful(line))), None)
        if text:
            return text
    return None


def render(run: RunView) -> Group:
    """The view as rich renders it: a headline, the host's memory and the budget, one row per step."""
    state = "ended" if run.ended and run.state == RunState.RUNNING else run.state
    style = VERDICT_STYLE.get(state, "cyan")
    head = Text.from_markup(
        f"[bold]eyrie[/] run {escape(run.run_id)} [{style}]{escape(state)}[/] ({escape(run.pipeline)})"
    )
    memory = Text("host at the end: " if run.ended else "host: ", style="bold")
    if run.host:
        host = run.host
        memory.append(
            f"{format_size(host['in_use'])} in use, {format_size(host['mem_available'])} MemAvailable "
            f"of {format_size(host['mem_total'])}"
        )
        if host["available"] < host["mem_available"]:
            memory.append(f" ({format_size(host['available'])} left by eyrie's cgroups)")
    elif not run.host_sampled:
        memory.append("not sampled: the steps run on the cluster's nodes", style="dim")
    else:
        memory.append("not sampled in this ledger", style="dim")
    memory.append(
        f"   budget {format_size(run.budget_bytes)}, running steps reserve {format_size(run.reserved_bytes)}"
    )
    table = Table(show_edge=False, pad_edge=False)
    for column, justify in [
        ("step", "left"),
        ("state", "left"),
        ("memory", "left"),
        ("in use / limit", "right"),
        ("peak", "right"),
        ("records", "right"),
        ("elapsed", "right"),
        ("last line", "left"),
    ]:
        table.add_column(
            column,
            justify=justify,
            no_wrap=True,
            overflow="ellipsis",
            max_width=60 if column == "last line" else None,
        )
    for step in run.steps:
        # A step waiting for its retry shows that, not the verdict of the attempt before.
        shown = (
            step.state
            if step.state in (StepState.PENDING, StepState.RUNNING, StepState.SKIPPED, StepState.BLOCKED)
            else step.verdict or step.state
        )
        bar: Any = ""
        used = ""
        if step.limit_bytes:
            if step.usage_bytes is not None:
                bar = ProgressBar(
                    total=step.limit_bytes, completed=min(step.usage_bytes, step.limit_bytes), width=20
                )
                used = f"{format_size(step.usage_bytes)} / {format_size(step.limit_bytes)}"
            else:
                used = f"limit {format_size(step.limit_bytes)}"
        table.add_row(
            escape(step.step),
            f"[{VERDICT_STYLE.get(shown, 'cyan')}]{escape(shown)}[/]"
            + (f" #{step.attempt}" if step.attempt and step.attempt > 1 else ""),
            bar,
            used,
            format_size(step.peak_bytes),
            "-" if step.records is None else f"{step.records:,}",
            format_duration(step.elapsed_s),
            Text(step.last_line or "", style="dim"),
        )
    parts: list[Any] = [head, memory, table]
    if run.note:
        parts.append(Text(run.note, style="yellow"))
    return Group(*parts)


def follow_command(run_dir: Path | None, runs: Path, json_output: bool, history: bool = False) -> int:
    """Follow the latest run of ``run_dir`` (else of the newest run under ``runs``) until it ends; its
    exit code is the run's, as `eyrie run`'s. ``history`` (status's --all) is refused: a live view
    shows the latest run only."""
    console, err = wide_console(), Console(stderr=True)
    if history:
        err.print(
            "[red]error:[/] status: --all and --follow do not go together (--all shows every run's "
            "attempts, --follow the latest run live); pass one of them",
            highlight=False,
            soft_wrap=True,
        )
        return EXIT_BAD_INPUT

    def read(ledger: Ledger, found: Path) -> int:
        return _follow_live(ledger, found, console, json_output)

    try:
        return read_run(run_dir, runs, err, read)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _follow_live(ledger: Ledger, run_dir: Path, console: Console, json_output: bool) -> int:
    current = view(ledger, run_dir)
    if current is None:
        Console(stderr=True).print(f"[red]error:[/] the ledger in {escape(str(run_dir))} holds no run yet")
        return EXIT_BAD_INPUT
    if json_output:
        while True:
            print(json.dumps(current.as_json()), flush=True)
            if current.ended:
                break
            time.sleep(REFRESH_S)
            current = view(ledger, run_dir)
    else:
        with Live(render(current), console=console, auto_refresh=False) as live:
            while not current.ended:
                time.sleep(REFRESH_S)
                current = view(ledger, run_dir)
                live.update(render(current), refresh=True)
    return RunState(current.state).exit_code  # as `eyrie run` exited
