"""What every executor that hands its attempts to a cluster's batch engine (Slurm; PBS or LSF alike)
needs, whatever the engine: its steps run on the cluster's nodes, and the runner sees them only
through the engine's controller and through the run directory, on a filesystem the nodes share.

- The run directory must be on such a filesystem (``mount_of``, ``SHARED_FILESYSTEMS``).
- The runner asks the controller about all its jobs at once, every ``POLL_S`` (``JobWatcher``).
- It follows the logs a job writes (``LogFollower``), and once the job ended waits for the in-job
  wrapper's report (``await_reports``): on NFS a file a node wrote last may show here only later.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.run.executor import STDERR_TAIL_LINES, LineSink

POLL_S = 1.0
"""How often the runner asks the batch engine about its jobs (one call for all of them)."""
REPORT_WAIT_S = 270.0
"""How long the runner waits, after a job ended, for its report to show on the shared filesystem
(NFS caches attributes and missing names for up to a minute): as Nextflow's exitReadTimeout."""
LOG_FOLLOW_S = 0.2

# Filesystems that several hosts mount: a run directory on one of them can be shared with the nodes.
SHARED_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "glusterfs", "fuse.glusterfs",
    "panfs", "wekafs", "fuse.juicefs", "cifs", "smb3", "virtiofs", "9p",
})  # fmt: skip


def mount_of(path: Path) -> tuple[str, str, str]:
    """(mount point, filesystem type, source) of the mount that holds ``path``."""
    best = ("/", "", "")
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        point = left.split()[4].replace("\\040", " ")
        fstype, source = (right.split() + ["", ""])[:2]
        if (path == Path(point) or Path(point) in path.parents) and len(point) >= len(best[0]):
            best = (point, fstype, source)
    return best


def short_hostname(host: str) -> str:
    return host.split(".", 1)[0]


class JobWatcher:
    """The states of every job the runner waits for, as the engine says them: one question for all
    of them every ``POLL_S``. An engine that does not answer changes nothing: silence is no answer.

    ``list_states(ids)`` asks the engine once: the states of those of ``ids`` it lists (one it no
    longer lists has ended and been forgotten), or None when it did not answer.
    """

    def __init__(
        self,
        list_states: Callable[[list[str]], dict[str, str] | None],
        ended_states: frozenset[str],
        queued_state: str,
        name: str,
    ) -> None:
        self._list_states = list_states
        self._ended_states = ended_states
        self._queued_state = queued_state
        self._name = name
        self._states: dict[str, str | None] = {}
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def watch(self, job_id: str) -> None:
        with self._changed:
            self._states.setdefault(job_id, self._queued_state)
            if self._thread is None:
                self._thread = threading.Thread(target=self._poll, name=self._name, daemon=True)
                self._thread.start()

    def state(self, job_id: str) -> str | None:
        """The job's last state seen; None once the engine no longer lists it (ended and forgotten)."""
        with self._changed:
            return self._states[job_id]

    def ended(self, job_id: str) -> bool:
        state = self.state(job_id)
        return state is None or state in self._ended_states

    def wait_change(self, timeout: float) -> None:
        with self._changed:
            self._changed.wait(timeout)

    def forget(self, job_id: str) -> None:
        with self._changed:
            self._states.pop(job_id, None)

    def close(self) -> None:
        """Stop asking (the runner is done with its jobs)."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join()

    def _poll(self) -> None:
        ended = self._ended_states
        while not self._closed.is_set():
            with self._changed:
                ids = [job for job, state in self._states.items() if state and state not in ended]
            if ids:
                self._ask(ids)
            self._closed.wait(POLL_S)

    def _ask(self, ids: list[str]) -> None:
        listed = self._list_states(ids)
        if listed is None:
            return  # no answer this time: ask again, never conclude from silence
        with self._changed:
            for job in ids:
                self._states[job] = listed.get(job)  # not listed: ended, and already forgotten
            self._changed.notify_all()


class LogFollower:
    """Follows a log file a job writes on the shared filesystem: lines to the sink, last lines kept."""

    def __init__(self, path: Path, name: str, sink: LineSink | None) -> None:
        self._path, self._name, self._sink = path, name, sink
        self.tail: list[str] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._follow, name=f"follow-{name}", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        handle = None
        pending = b""
        reopened = False
        while True:
            finishing = self._done.is_set()
            if finishing and not reopened:
                # A handle opened while the node wrote may not see its last writes on NFS: opening
                # the file again revalidates it (close-to-open), and the read goes on where it was.
                reopened = True
                offset = handle.tell() if handle is not None else 0
                if handle is not None:
                    handle.close()
                handle = _open_fresh(self._path)
                if handle is not None:
                    handle.seek(offset)
            if handle is None and not finishing and self._path.exists():
                handle = open(self._path, "rb")
            chunk = handle.read() if handle is not None else b""
            if chunk:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    self._emit(raw.decode("utf-8", errors="replace"))
            elif finishing:
                break
            else:
                time.sleep(LOG_FOLLOW_S)
        if pending:
            self._emit(pending.decode("utf-8", errors="replace"))
        if handle is not None:
            handle.close()

    def _emit(self, line: str) -> None:
        self.tail.append(line)
        if len(self.tail) > STDERR_TAIL_LINES:
            del self.tail[0]
        if self._sink is not None:
            self._sink(self._name, line)

    def finish(self, timeout: float = 5.0) -> None:
        """Read what is left (the job has ended) and stop."""
        self._done.set()
        self._thread.join(timeout)


def _open_fresh(path: Path):
    """``path`` opened for reading after listing its folder, so that NFS looks again for a name it
    lately found missing; None when it is not there."""
    try:
        if path.name not in os.listdir(path.parent):
            return None
        return open(path, "rb")
    except FileNotFoundError:
        return None


# -- the in-job wrapper's reports: ``report``, or with several nodes one per node, ``<report>.node-N.json``


def remove_reports(report: Path) -> None:
    """Remove an earlier try's reports, so that none is taken for this attempt's."""
    for stale in [report, *report.parent.glob(f"{report.name}.node-*.json")]:
        stale.unlink(missing_ok=True)


def read_reports(report: Path) -> list[dict[str, Any]]:
    """The reports there are now: the per-node ones, else ``report`` itself."""
    try:  # listing the folder makes NFS look again for names it lately found missing
        names = os.listdir(report.parent)
    except FileNotFoundError:
        return []
    per_node = sorted(n for n in names if n.startswith(f"{report.name}.node-") and n.endswith(".json"))
    reports = []
    for name in per_node or [report.name]:
        try:
            reports.append(json.loads((report.parent / name).read_text(encoding="utf-8")))
        except (FileNotFoundError, ValueError):
            continue
    return reports


def await_reports(report: Path, expected: int, wait_s: float) -> list[dict[str, Any]]:
    """The reports, waited for up to ``wait_s`` until ``expected`` of them are there (a job that
    ended may show its last files on the shared filesystem only later)."""
    deadline = time.monotonic() + wait_s
    while len(reports := read_reports(report)) < expected and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return reports


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One node's report, or several nodes' as one: the node that failed first decides the exit
    status, OOM kills add up, the peak and timeline are the largest node's."""
    if len(reports) == 1:
        return reports[0]
    failed = [r for r in reports if r["exit_code"] != 0]
    decisive = min(failed, key=lambda r: r["ended_at"]) if failed else reports[0]
    largest = max(reports, key=lambda r: r["peak_bytes"] or 0)
    ooms = [r["oom_at"] for r in reports if r["oom_at"] is not None]
    return {
        "exit_code": decisive["exit_code"],
        "signal": decisive["signal"],
        "oom_kills_before": sum(r["oom_kills_before"] for r in reports),
        "oom_kills_after": sum(r["oom_kills_after"] for r in reports),
        "oom_at": min(ooms) if ooms else None,
        "peak_bytes": largest["peak_bytes"],
        "anon_peak_bytes": max((r["anon_peak_bytes"] or 0) for r in reports) or None,
        "started_at": min(r["started_at"] for r in reports),
        "ended_at": max(r["ended_at"] for r in reports),
        "timeline": largest["timeline"],
        "thrash": next((r["thrash"] for r in reports if r.get("thrash")), None),
    }
