"""``eyrie run``: load the pipeline, pick the executor, stream the steps to the console."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from pipeline.contract.exits import EXIT_BAD_INPUT, say_error
from pipeline.memory import CgroupError, format_duration, format_size
from pipeline.run.disk import RunDirFull
from pipeline.run.executor import Executor, ExecutorError, Outcome, executor_class
from pipeline.run.ledger import LedgerFull, LedgerUnreadable
from pipeline.run.orchestrator import Orchestrator
from pipeline.run.recovery import RunDirBusy
from pipeline.run.spec import PipelineError, PipelineSpec, load_pipeline
from pipeline.run.verdict import DONE_VERDICTS, Decision, Verdict

# What a run is refused or stopped for, said in one line: the file, the executor, the cgroups, the
# run directory (busy, full) or its ledger (damaged, full).
REFUSED = (PipelineError, ExecutorError, CgroupError, RunDirBusy, RunDirFull, LedgerUnreadable, LedgerFull)
# What each signal that stops a run is to its user, as a cancelled attempt's reason says it.
SIGNAL_WORDS = {
    signal.SIGINT: "Ctrl-C (SIGINT)",
    signal.SIGTERM: "SIGTERM",
    signal.SIGHUP: "SIGHUP (its terminal closed)",
}
_PALETTE = ["cyan", "magenta", "green", "yellow", "blue", "bright_cyan", "bright_magenta"]


class ConsoleReporter:
    """Step output prefixed by the step's name, and one line per attempt's start and end."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._colors: dict[str, str] = {}
        self._lock = threading.Lock()

    def _tag(self, step: str) -> str:
        color = self._colors.setdefault(step, _PALETTE[len(self._colors) % len(_PALETTE)])
        return f"[{color}]{escape(step)}[/]"

    def _print(self, text: str) -> None:
        with self._lock:
            self.console.print(text, highlight=False, soft_wrap=True)

    def line(self, step: str, stream: str, text: str) -> None:
        style = "dim red" if stream == "stderr" else ""
        body = f"[{style}]{escape(text)}[/]" if style else escape(text)
        self._print(f"{self._tag(step)} │ {body}")

    def started(self, step: str, attempt: int, limit_bytes: int, limit_reason: str | None) -> None:
        why = f" — {escape(limit_reason)}" if limit_reason else ""
        self._print(f"{self._tag(step)} ▶ attempt {attempt}, memory limit {format_size(limit_bytes)}{why}")

    def ended(self, step: str, attempt: int, decision: Decision, outcome: Outcome) -> None:
        mark = "[green]✓[/]" if decision.verdict in DONE_VERDICTS else "[red]✗[/]"
        if decision.verdict == Verdict.COMPLETED_THEN_CRASHED:
            mark = "[yellow]![/]"
        wall = format_duration(outcome.ended_at - outcome.started_at)
        self._print(
            f"{self._tag(step)} {mark} [bold]{decision.verdict}[/] in {wall}, peak "
            f"{format_size(outcome.peak_bytes)} — {escape(decision.reason)}"
        )

    def skipped(self, step: str, reason: str) -> None:
        self._print(f"{self._tag(step)} [dim]↷ skipped, {escape(reason)}[/]")

    def blocked(self, step: str, reason: str) -> None:
        self._print(f"{self._tag(step)} [yellow]∅ {escape(reason)}[/]")

    def note(self, text: str) -> None:
        self._print(f"[bold]eyrie[/] {escape(text)}")


def make_executor(name: str, spec: PipelineSpec) -> Executor:
    """The executor registered as ``name``, given the pipeline's own options for it."""
    cls = executor_class(name)
    return cls(spec.executor_options(name))


def run_command(
    pipeline_file: Path,
    run_dir: Path,
    executor_name: str,
    check: Callable[[list[str], dict[str, str]], str | None] | None = None,
) -> int:
    """Run the pipeline; with ``check`` (what an ``eyrie`` command's options lack), only check it."""
    console = Console(stderr=False)
    errors = Console(stderr=True)
    try:
        executor_class(executor_name)  # an unknown name is said before the file is read
        spec = load_pipeline(pipeline_file)
        executor = make_executor(executor_name, spec)
        orchestrator = Orchestrator(spec, pipeline_file, run_dir, executor, ConsoleReporter(console))
    except (PipelineError, ExecutorError, CgroupError) as exc:
        say_error(str(exc))
        return EXIT_BAD_INPUT
    if check is not None:
        problems = orchestrator.check(check)
        for problem in problems:
            say_error(problem)
        if not problems:
            services = f", {len(spec.services)} service(s)" if spec.services else ""
            console.print(
                f"{escape(str(pipeline_file))}: ok, {len(spec.steps)} step(s){services}",
                highlight=False,
                soft_wrap=True,
            )
        return 2 if problems else 0

    def cancel(signum: int, _frame: object) -> None:
        errors.print(f"[yellow]eyrie: {signal.Signals(signum).name}: stopping the running steps…[/]")
        orchestrator.cancel(f"{SIGNAL_WORDS.get(signum, signal.Signals(signum).name)} to eyrie run")

    # SIGHUP (the terminal or SSH session closed) stops the run as SIGTERM does: recorded, not lost;
    # unless it is ignored already (nohup): then the run outlives its terminal, as asked.
    stopping = [signal.SIGINT, signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
        stopping.append(signal.SIGHUP)
    previous = {s: signal.signal(s, cancel) for s in stopping}
    try:
        result = orchestrator.run()
    except REFUSED as exc:
        say_error(str(exc))
        return EXIT_BAD_INPUT
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    color = {"succeeded": "green", "cancelled": "yellow"}.get(result.state, "red")
    console.print(
        f"[bold]eyrie[/] run {result.run_id} [{color}]{result.state}[/]; "
        f"see `eyrie status --run-dir {escape(str(run_dir))}`",
        highlight=False,
        soft_wrap=True,  # in a pipe or a log too, the command it suggests stays on one line
    )
    return result.exit_code
