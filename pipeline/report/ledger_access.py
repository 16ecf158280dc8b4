"""How the report commands reach a run's ledger: the run directory to read, and its ledger opened
read only, with one line and one exit status for a ledger that cannot be read. ``read_run`` is
every report command's opening: ``status``, ``explain``, ``status --follow`` and ``report``."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from pipeline.contract.exits import EXIT_BAD_INPUT
from pipeline.run.ledger import LEDGER_NAME, Ledger, unreadable_line


def resolve_run_dir(run_dir: Path | None, runs: Path, err: Console) -> Path | None:
    """``run_dir`` when given; else the folder under ``runs`` whose ledger's latest run started last,
    named on ``err``. None, said in one line, when there is none."""
    if run_dir is not None:
        return run_dir
    newest: tuple[float, Path] | None = None
    for path in sorted(runs.glob(f"*/{LEDGER_NAME}")):
        try:
            with closing(Ledger(path.parent, create=False)) as ledger:
                latest = ledger.latest_run()
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


@contextmanager
def opened_ledger(run_dir: Path, err: Console) -> Iterator[Ledger | None]:
    """The ledger of ``run_dir``, read only, closed when the block ends; None when there is none or
    SQLite cannot open it. An ``sqlite3.Error`` raised in the block ends the block there. Either is
    said in one line on ``err``; the command, past the block, exits ``EXIT_BAD_INPUT`` (as
    ``read_run`` does)."""
    ledger = None
    try:
        ledger = Ledger(run_dir, create=False)
    except FileNotFoundError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
    except sqlite3.Error as exc:
        _unreadable(Path(run_dir) / LEDGER_NAME, exc, err)
    if ledger is None:
        yield None
        return
    try:
        yield ledger
    except sqlite3.Error as exc:
        _unreadable(ledger.path, exc, err)
    finally:
        ledger.close()


def read_run(run_dir: Path | None, runs: Path, err: Console, read: Callable[[Ledger, Path], int]) -> int:
    """``read(ledger, run_dir)``'s exit status on the run ``resolve_run_dir`` picks, its ledger open
    read only; ``EXIT_BAD_INPUT``, said in one line on ``err``, when there is no such run or its
    ledger cannot be read."""
    resolved = resolve_run_dir(run_dir, runs, err)
    if resolved is None:
        return EXIT_BAD_INPUT
    with opened_ledger(resolved, err) as ledger:
        if ledger is not None:
            return read(ledger, resolved)
    return EXIT_BAD_INPUT


def _unreadable(path: Path, exc: sqlite3.Error, err: Console) -> None:
    """One line for a ledger SQLite cannot read."""
    fix = "check that it is an eyrie ledger you may read, or pass the right --run-dir"
    err.print(f"[red]error:[/] {escape(unreadable_line(path, exc, fix))}", highlight=False, soft_wrap=True)
