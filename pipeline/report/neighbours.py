"""What the host had when an attempt died: its memory, the steps beside it, and what that means.

"Was it OOM?" has three answers a reader must tell apart: the step was over its
own limit; the host (or the cgroup the steps share) was full because of
something else; or memory was not short, so the cause is elsewhere. The
ledger's samples of the host and of every attempt answer it for the moment the
attempt was killed or crashed. The host is judged as the step's executor saw
it; where the steps ran on machines the runner could not see (Slurm's nodes),
only the step's own limit is.
"""

from __future__ import annotations

from pipeline.memory import format_size
from pipeline.report.timeline import (
    CRASH_ENDINGS,
    MEMORY_ENDINGS,
    OOM_KILL_ENDINGS,
    RunTimeline,
    Track,
    clock,
    timeline_of,
)
from pipeline.run.ledger import AttemptRow, HostSample, Ledger
from pipeline.run.verdict import Verdict

NEAR_LIMIT = 0.9  # memory this close to its limit: the limit is what stopped the attempt
HOST_FULL = 0.05  # less than this share left of the memory the steps share: it was full


def neighbours(ledger: Ledger, row: AttemptRow, timeline: RunTimeline | None = None) -> list[str]:
    """Sentences on the host and the other attempts at the moment ``row`` was killed or crashed.

    ``timeline``: the run of ``row``, where the caller has it. A report of many attempts passes each
    run's, built once: building it reads all of the run's samples from the ledger."""
    if row.verdict not in MEMORY_ENDINGS | CRASH_ENDINGS:
        return []
    if timeline is None:
        timeline = timeline_of(ledger, row)
    track = next((t for t in timeline.tracks if t.row.id == row.id), None) if timeline else None
    if timeline is None or track is None or track.event is None:
        return []
    moment, what = track.event
    when = f"At {clock(moment)}, " + (
        "when its OOM kill was counted" if what == "OOM kill" else "when it ended"
    )
    if timeline.steps_elsewhere:
        return [
            f"{when}, it ran on a node of the cluster ({row.executor} executor, {row.location or '-'}), "
            "not on the runner's host: eyrie has no record of that node's memory, nor of what else ran "
            "there, so only its own limit can be judged.",
            _judgement(row, None, []),
        ]
    host = timeline.host_at(moment)
    beside = [(t, t.usage_at(moment)) for t in timeline.running_at(moment) if t.row.id != row.id]
    lines = []
    if host is None:
        lines.append(
            f"{when}: the ledger has no record of the host's memory then (it was written before eyrie "
            f"sampled the host); at the attempt's start the host had {format_size(row.host_mem_available)} "
            f"available of {format_size(row.host_mem_total)}."
        )
    else:
        cgroups = (
            f"; the cgroups eyrie runs in left it {format_size(host.available)}"
            + (f" of their {format_size(host.pool)} limit" if host.pool < host.mem_total else "")
            if host.available < host.mem_available * (1 - HOST_FULL)
            else ""
        )
        lines.append(
            f"{when}, the host had {format_size(host.in_use)} in use and {format_size(host.mem_available)} "
            f"MemAvailable of {format_size(host.mem_total)}{cgroups}."
        )
    if beside:
        held = sum(usage or 0 for _, usage in beside)
        listed = ", ".join(
            f"{_name(t)} {format_size(usage)} of its {format_size(t.row.limit_bytes)} limit"
            for t, usage in sorted(beside, key=lambda b: -(b[1] or 0))
        )
        others = ""
        if host is not None:
            # The host's "in use" leaves out page cache it can reclaim: set the steps' anonymous
            # memory against it, not their cgroups' charge.
            steps_anon = sum(t.usage_at(moment, anon=True) or 0 for t in timeline.running_at(moment))
            others = f"; the rest of the host {format_size(max(0, host.in_use - steps_anon))}"
        lines.append(f"Beside it ran: {listed} ({format_size(held)} in all{others}).")
    else:
        lines.append("No other step of the run was running.")
    lines.append(_judgement(row, host, beside))
    return lines


def _judgement(row: AttemptRow, host: HostSample | None, beside: list[tuple[Track, int | None]]) -> str:
    killed = row.verdict in OOM_KILL_ENDINGS
    # An OOM kill means the cgroup was full, page cache included; any other ending is judged by
    # the anonymous memory, as page cache alone fills a cgroup that reads files and harms no one.
    used = (row.peak_bytes if killed else row.anon_peak_bytes or row.peak_bytes) or 0
    share = used / row.limit_bytes if row.limit_bytes else 0.0
    # Full is judged against what the steps share: the host's memory, or, where a cgroup above
    # the steps binds, that cgroup's limit (a runner in a small cgroup on a roomy host is not full).
    full = host is not None and host.available < HOST_FULL * host.pool
    measure = "its memory, page cache included," if killed else "its anonymous memory"
    of_limit = f"{format_size(used)} of its {format_size(row.limit_bytes)} limit"
    if share >= NEAR_LIMIT:
        room = f" while {_shared_memory(host)} had {format_size(host.available)} available" if host else ""
        also = f" {_shared_memory(host).capitalize()} was nearly full as well." if full else ""
        return (
            f"Over its own limit: {measure} reached {of_limit}{room}; its limit stopped it, not the host. "
            f"Raise its memory (the step's memory:) or make it use less.{also}"
        )
    if full:
        largest = max(beside, key=lambda b: b[1] or 0, default=None)
        culprit = f" (the largest beside it: {_name(largest[0])})" if largest and largest[1] else ""
        shared = _shared_memory(host)
        return (
            f"{shared.capitalize()} was full because of something else: {measure} peaked at {of_limit}, "
            f"but {shared} had only {format_size(host.available)} available of {format_size(host.pool)}"
            f"{culprit}. Free memory there, or lower the pipeline's budget so fewer steps run together."
        )
    if host is None:
        return f"{measure.capitalize()} peaked at {of_limit}: its own limit did not stop it."
    if killed:
        return (
            f"An OOM kill was counted while {measure} peaked at only {of_limit} and the host had "
            f"{format_size(host.available)} available: a cgroup above it may have reached its own limit "
            "(see `eyrie memory`)."
        )
    free = host.available / host.pool if host.pool else 0.0
    low = (
        f"Memory was not short: {measure} peaked at {of_limit} ({share:.0%}) and {_shared_memory(host)} "
        f"had {free:.0%} of its memory available"
    )
    if row.verdict == Verdict.MEMORY_ERROR.value:
        return f"{low}: the allocation that failed asked for more than there was; see its size in stderr."
    return f"{low}, so memory did not end it; look at its exit status and stderr instead."


def _shared_memory(host: HostSample) -> str:
    """What the steps share: the host, or the cgroup eyrie runs in where its limit binds."""
    return "the host" if host.pool >= host.mem_total else "the cgroup eyrie runs in"


def _name(track: Track) -> str:
    return track.row.step if track.row.attempt == 1 else f"{track.row.step} (attempt {track.row.attempt})"
