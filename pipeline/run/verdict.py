"""One verdict per attempt, decided from evidence (docs/ledger.md, "Reading the ledger").

Exit 137 is not evidence of an OOM kill, and neither is Docker's OOMKilled
flag: only the cgroup's OOM-kill counter rising during the attempt is, or the
runner's own kill of an attempt that thrashed at its limit (``run/monitor.py``).
"""

from __future__ import annotations

import enum
import re
import signal
from dataclasses import dataclass

from pipeline.run.executor import Outcome


class Verdict(str, enum.Enum):
    SUCCEEDED = "succeeded"
    OOM_KILLED = "oom_killed"
    CHILD_OOM_KILLED = "child_oom_killed"
    COMPLETED_THEN_CRASHED = "completed_then_crashed"
    MEMORY_ERROR = "memory_error"
    CRASHED = "crashed"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"
    NODE_FAILED = "node_failed"

    def __str__(self) -> str:
        return self.value


# The cgroup's OOM-kill counter rose during the attempt.
OOM_KILL_VERDICTS = frozenset({Verdict.OOM_KILLED, Verdict.CHILD_OOM_KILLED})
# Memory ran short: a larger limit may help, so these are retried by default (a step's `retry_on`).
MEMORY_VERDICTS = OOM_KILL_VERDICTS | {Verdict.MEMORY_ERROR}
# The step's outputs can be used: the pipeline goes on.
DONE_VERDICTS = frozenset({Verdict.SUCCEEDED, Verdict.COMPLETED_THEN_CRASHED})
# A scheduler took the attempt's node away (Slurm's PREEMPTED, NODE_FAIL): nothing about the
# step is learned, so it is run again as it was, whatever its retry policy says.
TRANSIENT_VERDICTS = frozenset({Verdict.PREEMPTED, Verdict.NODE_FAILED})

_MEMORY_ERROR = re.compile(
    r"\bMemoryError\b|std::bad_alloc|Cannot allocate memory|out of memory|OutOfMemoryError",
    re.IGNORECASE,
)
# GPU memory ran out: a memory_error would be retried with a larger host limit, which cannot help.
_GPU_OUT_OF_MEMORY = re.compile(
    r"\b(?:CUDA|HIP)\b.{0,20}\bout of memory|\btorch(?:\.cuda)?\.OutOfMemoryError\b"
    r"|CUBLAS_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str
    """One line: the evidence that decided the verdict."""


def decide(
    outcome: Outcome, outputs_complete: bool, outputs_detail: str, cancelled_by: str | None = None
) -> Decision:
    """The verdict of an attempt, from what the executor saw and the state of its outputs;
    ``cancelled_by``: what stopped the run, said when the attempt was cancelled."""
    decision = _decide(outcome, outputs_complete, outputs_detail, cancelled_by)
    if outcome.evidence is None:
        return decision
    return Decision(decision.verdict, f"{decision.reason} (decided from {outcome.evidence})")


def decide_service(outcome: Outcome, *, served: bool, not_ready: str | None) -> Decision:
    """The verdict of a service's replica. ``served``: its service was ready and the runner stopped
    it once no longer needed, which is how a service succeeds; ``not_ready``: why it never answered
    its health path, if it did not. Memory evidence decides first, as for a step."""
    if outcome.runner_error is None and outcome.oom_kills == 0 and outcome.thrash is None:
        ended = _ending(outcome)
        if served and outcome.stopped_by == "cancel":
            return Decision(Verdict.SUCCEEDED, f"served until it was no longer needed, then stopped; {ended}")
        if outcome.stopped_by == "timeout" and not_ready:
            return Decision(Verdict.TIMED_OUT, f"{not_ready}; {ended}")
        if outcome.stopped_by is None and outcome.exit_code == 0:
            return Decision(Verdict.FAILED, f"{ended} while its users still needed it")
    decision = decide(outcome, False, "a service declares no outputs")
    if not_ready and decision.verdict not in (Verdict.CANCELLED, Verdict.TIMED_OUT):
        return Decision(decision.verdict, f"{decision.reason}; {not_ready}")
    return decision


def _decide(
    outcome: Outcome, outputs_complete: bool, outputs_detail: str, cancelled_by: str | None
) -> Decision:
    if outcome.runner_error is not None:
        return Decision(Verdict.FAILED, f"the runner lost track of it: {outcome.runner_error}")
    ended = _ending(outcome)
    if outcome.stopped_by == "timeout":
        return Decision(Verdict.TIMED_OUT, f"stopped at its timeout; {ended}")
    if outcome.stopped_by == "cancel":
        by = f" by {cancelled_by}" if cancelled_by else ""
        return Decision(Verdict.CANCELLED, f"cancelled{by}; {ended}")
    if outcome.stopped_by == "preempted":
        return Decision(Verdict.PREEMPTED, f"the scheduler preempted it for another job; {ended}")
    if outcome.stopped_by == "node_failed":
        return Decision(Verdict.NODE_FAILED, f"its node failed; {ended}")
    if outcome.oom_kills == 0 and outcome.thrash is not None:
        return Decision(Verdict.OOM_KILLED, f"the runner killed it out of memory: {outcome.thrash}; {ended}")
    if outcome.oom_kills > 0:
        counter = f"oom_kill went {outcome.oom_kills_before}→{outcome.oom_kills_after} in its cgroup"
        if outcome.signal == signal.SIGKILL:
            return Decision(Verdict.OOM_KILLED, f"{counter}; {ended}")
        return Decision(
            Verdict.CHILD_OOM_KILLED,
            f"{counter}, but the main process was not the one killed: {ended}",
        )
    if outcome.exit_code == 0:
        if outputs_complete:
            return Decision(Verdict.SUCCEEDED, f"exit 0; {outputs_detail}")
        return Decision(Verdict.FAILED, f"exit 0 but the outputs are not complete: {outputs_detail}")
    if outputs_complete:
        return Decision(
            Verdict.COMPLETED_THEN_CRASHED,
            f"its outputs were complete ({outputs_detail}), then {ended}",
        )
    gpu_line = next((line for line in outcome.stderr_tail if _GPU_OUT_OF_MEMORY.search(line)), None)
    if gpu_line is not None:
        return Decision(
            Verdict.FAILED,
            f"{ended} after running out of GPU memory: {gpu_line.strip()}; a larger host memory limit "
            "would not help: lower the batch size or sequence length, or use more GPUs",
        )
    memory_line = next((line for line in outcome.stderr_tail if _MEMORY_ERROR.search(line)), None)
    if memory_line is not None:
        return Decision(
            Verdict.MEMORY_ERROR,
            f"{ended} after an allocation failure without an OOM kill: {memory_line.strip()}",
        )
    if outcome.signal is not None:
        return Decision(Verdict.CRASHED, f"{ended}, and no OOM kill was counted in its cgroup")
    last = next((text for line in reversed(outcome.stderr_tail) if (text := meaningful(line))), None)
    return Decision(Verdict.FAILED, f"{ended}" + (f": {last}" if last else ""))


def _ending(outcome: Outcome) -> str:
    if outcome.exit_code is None and outcome.signal is None:
        return "how the main process ended is unknown"
    if outcome.signal is not None:
        return f"the main process died of {outcome.signal_name}"
    return f"the main process exited with {outcome.exit_code}"


# Box-drawing and block characters: the frames rich and other libraries draw around messages.
_FRAME = "".join(chr(c) for c in range(0x2500, 0x25A0))


def meaningful(line: str) -> str:
    """A stderr line without the whitespace and frame characters around it; '' for a blank or
    decoration-only line such as ``╰──────╯``."""
    return line.strip(_FRAME + " \t\r\n")
