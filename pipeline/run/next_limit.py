"""The memory limit of a step's next attempt, after one that ended with a verdict its ``retry_on``
names: raised from the peak by its ``memory_growth`` after a memory verdict, else unchanged."""

from __future__ import annotations

import math

from pipeline.memory import MIB, format_size
from pipeline.run.executor import Outcome
from pipeline.run.spec import StepSpec
from pipeline.run.verdict import MEMORY_VERDICTS, Verdict


def next_limit(
    step: StepSpec, verdict: Verdict, limit: int, outcome: Outcome, pool: int
) -> tuple[int | None, str]:
    """The next limit (whole MiB, at most ``pool``) and why; None when it cannot rise above ``limit``."""
    if verdict not in MEMORY_VERDICTS:
        return limit, f"attempt after {verdict}, retry_on names it; limit unchanged"
    basis = max(limit, outcome.peak_bytes or 0)
    wanted = math.ceil(basis * step.memory_growth / MIB) * MIB
    new = min(wanted, pool)
    if new <= limit:
        return (
            None,
            f"cannot raise the limit above {format_size(limit)}: the budget is {format_size(pool)}",
        )
    capped = " (capped by the budget)" if new < wanted else ""
    return new, (
        f"limit raised from {format_size(limit)} to {format_size(new)}{capped} after {verdict}: "
        f"peak {format_size(outcome.peak_bytes)} × {step.memory_growth}"
    )
