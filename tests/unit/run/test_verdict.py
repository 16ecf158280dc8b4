"""The verdict table (docs/ledger.md, "Reading the ledger"), decided from evidence alone."""

import signal

import pytest

from pipeline.run.executor import Outcome
from pipeline.run.verdict import Verdict, decide


def outcome(exit_code=None, sig=None, kills=0, stopped_by=None, stderr=()):
    return Outcome(
        exit_code=exit_code,
        signal=sig,
        oom_kills_before=5,
        oom_kills_after=5 + kills,
        oom_at=None,
        peak_bytes=1,
        anon_peak_bytes=1,
        started_at=0,
        ended_at=1,
        stopped_by=stopped_by,
        stderr_tail=list(stderr),
    )


@pytest.mark.parametrize(
    "evidence,complete,expected",
    [
        (outcome(0), True, Verdict.SUCCEEDED),
        (outcome(0), False, Verdict.FAILED),
        (outcome(sig=signal.SIGKILL, kills=1), False, Verdict.OOM_KILLED),
        (outcome(0, kills=1), True, Verdict.CHILD_OOM_KILLED),
        (outcome(1, kills=2), False, Verdict.CHILD_OOM_KILLED),
        (outcome(sig=signal.SIGKILL), False, Verdict.CRASHED),  # exit 137 is not OOM evidence
        (outcome(137), False, Verdict.FAILED),
        (outcome(134), True, Verdict.COMPLETED_THEN_CRASHED),
        (outcome(sig=signal.SIGABRT), True, Verdict.COMPLETED_THEN_CRASHED),
        (outcome(sig=signal.SIGSEGV), False, Verdict.CRASHED),
        (outcome(1, stderr=["Traceback", "MemoryError"]), False, Verdict.MEMORY_ERROR),
        (
            outcome(sig=signal.SIGABRT, stderr=["terminate called after throwing 'std::bad_alloc'"]),
            False,
            Verdict.MEMORY_ERROR,
        ),
        (outcome(1, stderr=["ValueError: bad row"]), False, Verdict.FAILED),
        (outcome(sig=signal.SIGKILL, kills=1, stopped_by="timeout"), False, Verdict.TIMED_OUT),
        (outcome(sig=signal.SIGTERM, stopped_by="cancel"), False, Verdict.CANCELLED),
    ],
)
def test_verdicts(evidence, complete, expected):
    decision = decide(evidence, complete, "manifest matches the files" if complete else "no manifest")
    assert decision.verdict == expected
    assert decision.reason and "\n" not in decision.reason


def test_oom_reason_names_the_counter():
    decision = decide(outcome(sig=signal.SIGKILL, kills=1), False, "no manifest")
    assert "oom_kill went 5→6" in decision.reason and "SIGKILL" in decision.reason


def test_failed_reason_keeps_the_last_stderr_line():
    decision = decide(outcome(2, stderr=["x", "KeyError: 'messages'", ""]), False, "no manifest")
    assert decision.reason.endswith("KeyError: 'messages'")


@pytest.mark.parametrize(
    "line",
    [
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total "
        "capacity of 139.72 GiB of which 1.2 GiB is free.",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 MiB",
        "RuntimeError: CUDA error: out of memory",
    ],
)
def test_gpu_out_of_memory_is_failed_not_a_host_memory_error(line):
    # a larger host memory limit cannot help: no retry after memory_error
    decision = decide(outcome(1, stderr=["Traceback (most recent call last):", line]), False, "no manifest")
    assert decision.verdict == Verdict.FAILED
    assert "GPU memory" in decision.reason and "host memory limit would not help" in decision.reason
    assert "batch size" in decision.reason


def test_the_evidence_line_skips_frames_and_blank_lines():
    # typer (rich) prints a usage error in a box: the message is inside it, not its bottom edge.
    tail = [
        "Usage: eyrie tokenize [OPTIONS]",
        "╭─ Error ─────────────────────╮",
        "│ Missing option '--tokenizer'. │",
        "╰─────────────────────────────╯",
        "",
        "  ",
    ]
    decision = decide(outcome(2, stderr=tail), False, "no manifest")
    assert decision.reason == "the main process exited with 2: Missing option '--tokenizer'."
