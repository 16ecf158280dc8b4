"""When a cgroup at its limit is thrashing rather than merely full (run/monitor.py's ThrashWatch)."""

from __future__ import annotations

from pipeline.memory import MemorySample
from pipeline.run.executor import Outcome
from pipeline.run.monitor import THRASH_S, ThrashWatch
from pipeline.run.verdict import Verdict, decide

MiB = 2**20
LIMIT = 1024 * MiB


def watch_over(samples: list[tuple[float, MemorySample]], limit: int | None = LIMIT) -> list[str | None]:
    watch = ThrashWatch(limit)
    return [watch.observe(now, sample) for now, sample in samples]


def seconds(until: float, step: float = 1.0):
    now = 0.0
    while now <= until:
        yield now
        now += step


def test_anonymous_memory_at_the_limit_reading_pages_back_in_is_thrashing_after_thrash_s():
    seen = watch_over(
        [
            (t, MemorySample(total=LIMIT, anon=LIMIT - 10 * MiB, file=10 * MiB, major_faults=int(70 * t)))
            for t in seconds(THRASH_S + 1)
        ]
    )
    assert all(evidence is None for evidence in seen[: int(THRASH_S)])
    evidence = seen[int(THRASH_S)]
    assert evidence is not None
    assert "1014.00 MiB of its 1.00 GiB limit for 20 s" in evidence
    assert "read 1400 pages back in (70/s)" in evidence and "thrashing" in evidence


def test_a_limit_full_of_page_cache_is_not_thrashing_however_much_it_reads():
    """A step streaming a checkpoint through the page cache fills its limit with cache: the kernel
    drops that cache as it goes, and nothing is wrong."""
    seen = watch_over(
        [
            (t, MemorySample(total=LIMIT, anon=300 * MiB, file=LIMIT - 300 * MiB, major_faults=int(5000 * t)))
            for t in seconds(3 * THRASH_S)
        ]
    )
    assert seen == [None] * len(seen)


def test_a_step_holding_steady_at_its_limit_without_reading_back_is_not_thrashing():
    seen = watch_over(
        [
            (t, MemorySample(total=LIMIT, anon=LIMIT - MiB, file=MiB, major_faults=100 + int(t // 10)))
            for t in seconds(3 * THRASH_S)
        ]
    )
    assert seen == [None] * len(seen)


def test_dropping_below_the_limit_starts_the_count_again():
    samples = []
    for t in seconds(2 * THRASH_S):
        anon = LIMIT - 10 * MiB if int(t) % 15 else 100 * MiB  # freed memory every 15 s
        samples.append((t, MemorySample(total=LIMIT, anon=anon, file=10 * MiB, major_faults=int(70 * t))))
    assert watch_over(samples) == [None] * len(samples)


def test_without_a_limit_nothing_is_thrashing():
    sample = MemorySample(total=LIMIT, anon=LIMIT, file=0, major_faults=0)
    assert watch_over([(t, sample) for t in seconds(3 * THRASH_S)], limit=None) == [None] * 61


def test_a_runners_thrash_kill_is_an_oom_kill_that_names_its_evidence():
    outcome = Outcome(
        exit_code=None,
        signal=9,
        oom_kills_before=0,
        oom_kills_after=0,
        oom_at=None,
        peak_bytes=LIMIT,
        anon_peak_bytes=LIMIT,
        started_at=0.0,
        ended_at=30.0,
        thrash="its anonymous memory held …",
    )
    decision = decide(outcome, False, "no result")
    assert decision.verdict is Verdict.OOM_KILLED
    assert decision.reason == (
        "the runner killed it out of memory: its anonymous memory held …; the main process died of SIGKILL"
    )
