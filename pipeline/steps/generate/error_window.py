"""The error rate over a sliding window of rows: a run stops when too many of its last rows failed
(``--max-error-rate`` over ``--error-window``)."""

from __future__ import annotations

from collections import deque


class ErrorRateExceeded(Exception):
    pass


class ErrorWindow:
    """The share of failed rows among the last ``size`` rows that ended.

    Judged once the window is full, or once every row of a shorter run has ended: a
    few early failures of a long run say nothing yet.
    """

    def __init__(self, size: int, limit: float, rows_to_do: int) -> None:
        self.limit = limit
        self.outcomes: deque[bool] = deque(maxlen=size)
        self.failed = 0
        self.judged_from = max(1, min(size, rows_to_do))

    def add(self, failed: bool) -> bool:
        """Record one row; returns whether the failure rate is now above the limit."""
        outcomes = self.outcomes
        if len(outcomes) == outcomes.maxlen:
            self.failed -= outcomes[0]
        outcomes.append(failed)
        self.failed += failed
        n = len(outcomes)
        return n >= self.judged_from and self.failed > self.limit * n
