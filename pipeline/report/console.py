"""What the report commands print on: a console as wide as their tables, and each verdict's style."""

from __future__ import annotations

from rich.console import Console

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


def wide_console() -> Console:
    """A console that does not squeeze tables to 80 columns when output is piped or logged."""
    console = Console()
    return console if console.is_terminal else Console(width=160)
