"""How every eyrie command ends: its exit status and its ``error:`` lines.

A step, the runner, a report and ``eyrie provision`` alike: each status eyrie gives a meaning to
is defined here and nowhere else.
"""

from __future__ import annotations

import signal
import sys

EXIT_FAILED = 1
"""The exit status of an eyrie command (or run) that failed for a cause other than its input."""
EXIT_BAD_INPUT = 2
"""The exit status of every eyrie command refused for its input (an ``error:`` line says why)."""
EXIT_INTERRUPTED = 128 + signal.SIGINT
"""The exit status of a process stopped by SIGINT (Ctrl-C), as a shell reports it: 128 + the signal."""


def error_lines(message: str) -> str:
    """``message`` as every eyrie command says an error: each of its lines after ``error:``."""
    return "\n".join(f"error: {line}" for line in message.splitlines() or [""])


def say_error(message: str) -> None:
    """Print ``message`` on stderr as an error (``error_lines``)."""
    print(error_lines(message), file=sys.stderr, flush=True)


__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILED", "EXIT_INTERRUPTED", "error_lines", "say_error"]
