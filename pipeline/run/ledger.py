"""The ledger: every run, every step's state and every attempt's facts, in SQLite.

WAL mode lets ``eyrie status`` read while a run writes, and writes from
several finishing steps are serialised by one lock around one connection.
"""

from __future__ import annotations

import enum
import errno
import json
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pipeline.contract.exits import EXIT_FAILED, EXIT_INTERRUPTED
from pipeline.contract.step import STATE_DIR
from pipeline.memory import KIB
from pipeline.run.disk import space_left

LEDGER_NAME = "ledger.sqlite"
LEDGER_FILES = tuple(LEDGER_NAME + suffix for suffix in ("", "-wal", "-shm", "-journal"))
"""The ledger and the files SQLite keeps beside it."""
RESERVE_BYTES = 256 * KIB  # what the ledger's reserve holds: the writes of a run's end, many times over
T = TypeVar("T")


class RunState(str, enum.Enum):
    """How a run stands (the ``runs`` table); ``eyrie run`` exits with its ``exit_code``."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value

    @property
    def exit_code(self) -> int:
        return {RunState.SUCCEEDED: 0, RunState.CANCELLED: EXIT_INTERRUPTED}.get(self, EXIT_FAILED)


class StepState(str, enum.Enum):
    """Where a step of a run stands (the ``step_states`` table)."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    SKIPPED = "skipped"
    """Up to date: its manifest matches its outputs and inputs."""
    FAILED = "failed"
    BLOCKED = "blocked"
    """Not run: a step it needs failed or was cancelled."""
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value


_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    pipeline TEXT NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL,
    state TEXT NOT NULL,             -- running | succeeded | failed | cancelled
    orchestrator_pid INTEGER NOT NULL,
    host TEXT NOT NULL,
    executor TEXT NOT NULL,
    budget_bytes INTEGER,
    budget_binding TEXT,
    steps TEXT NOT NULL              -- JSON list of step names in order
);
CREATE TABLE IF NOT EXISTS step_states (
    run_id TEXT NOT NULL,
    step TEXT NOT NULL,
    state TEXT NOT NULL,             -- pending | running | done | skipped | failed | blocked | cancelled
    detail TEXT NOT NULL DEFAULT '',
    updated_at REAL NOT NULL,
    PRIMARY KEY (run_id, step)
);
CREATE TABLE IF NOT EXISTS attempts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL,
    step TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    state TEXT NOT NULL,             -- running | ended
    verdict TEXT,
    reason TEXT,
    executor TEXT NOT NULL,
    pid INTEGER,
    orchestrator_pid INTEGER NOT NULL,
    location TEXT,
    limit_bytes INTEGER NOT NULL,
    limit_reason TEXT,
    peak_bytes INTEGER,
    anon_peak_bytes INTEGER,
    oom_kills INTEGER,
    oom_kills_before INTEGER,
    oom_kills_after INTEGER,
    oom_at REAL,
    exit_code INTEGER,
    signal INTEGER,
    started_at REAL NOT NULL,
    ended_at REAL,
    host_mem_available INTEGER,
    host_mem_total INTEGER,
    image TEXT,
    commit_id TEXT,
    records INTEGER,
    stderr_tail TEXT,
    argv TEXT NOT NULL,
    UNIQUE (step, attempt)
);
CREATE TABLE IF NOT EXISTS samples (
    attempt_id INTEGER NOT NULL REFERENCES attempts(id),
    t REAL NOT NULL,
    total_bytes INTEGER NOT NULL,
    anon_bytes INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS samples_by_attempt ON samples(attempt_id);
CREATE TABLE IF NOT EXISTS host_samples (
    run_id TEXT NOT NULL,
    t REAL NOT NULL,                 -- wall-clock time; each row holds the least memory of its second
    mem_total INTEGER NOT NULL,
    mem_available INTEGER NOT NULL,  -- /proc/meminfo MemAvailable
    available INTEGER NOT NULL       -- what the runner really has: MemAvailable and its cgroups' headroom
);
CREATE INDEX IF NOT EXISTS host_samples_by_run ON host_samples(run_id, t);
CREATE TABLE IF NOT EXISTS reservations (  -- compile jobs: what a build holds for an attempt, over time
    attempt_id INTEGER NOT NULL REFERENCES attempts(id),
    t REAL NOT NULL,                 -- from this moment (unix time) until the next row or the attempt's end
    reserved_bytes INTEGER NOT NULL, -- held in the build's budget (the attempt's cgroup limit, if it has one)
    expected_bytes INTEGER,          -- the peak, then the rest, expected from measurements; NULL: a default
    reason TEXT NOT NULL
);
"""

# Columns added since their tables were first released, with what they hold: a ledger that lacks
# them gains them when a run writes to it, and readers take a missing one as NULL.
_ADDED_COLUMNS = {
    "runs": {
        # 0: the executor's steps run on machines this one cannot see (Slurm), so no host samples
        "host_sampled": "INTEGER",
        # the runner's last sign of life in a second it wrote no host sample (one row a second)
        "heartbeat_at": "REAL",
    },
    # JSON list: the outputs the step declared; replica: which replica of a service (NULL: a step);
    # run_reason: why the step ran (what changed since it last ran, or its last verdict);
    # fingerprint_parts: JSON, what its fingerprint was made of (a later run says which changed)
    "attempts": {"outputs": "TEXT", "replica": "INTEGER", "run_reason": "TEXT", "fingerprint_parts": "TEXT"},
    # what `available` is left of: the limit of the cgroup that bound it, else MemTotal
    "host_samples": {"capacity": "INTEGER"},
}

ATTEMPT_JSON_FIELDS = (
    "run_id",
    "step",
    "attempt",
    "state",
    "verdict",
    "reason",
    "executor",
    "pid",
    "location",
    "limit_bytes",
    "limit_reason",
    "peak_bytes",
    "anon_peak_bytes",
    "oom_kills",
    "oom_kills_before",
    "oom_kills_after",
    "oom_at",
    "exit_code",
    "signal",
    "started_at",
    "ended_at",
    "host_mem_available",
    "host_mem_total",
    "image",
    "commit_id",
    "records",
)


def _connect(target: str | Path, *, uri: bool = False) -> sqlite3.Connection:
    return sqlite3.connect(target, uri=uri, timeout=30, check_same_thread=False, isolation_level=None)


def _connect_read_only(path: Path) -> sqlite3.Connection:
    """A connection that never writes the ledger: readers may have no write access to it."""
    uri = path.resolve().as_uri()
    db = _connect(f"{uri}?mode=ro", uri=True)
    try:
        db.execute("PRAGMA schema_version").fetchone()
    except sqlite3.OperationalError as exc:
        db.close()
        no_index = exc.sqlite_errorcode in (sqlite3.SQLITE_READONLY_DIRECTORY, sqlite3.SQLITE_CANTOPEN)
        if not no_index or path.with_name(f"{path.name}-wal").exists():
            raise
        # WAL is read through a -shm index file, which a folder we cannot write cannot hold;
        # with no -wal file (no run writing) every row is in the main file, read as it is.
        db = _connect(f"{uri}?immutable=1", uri=True)
    return db


@dataclass(frozen=True)
class HostSample:
    """The memory of the machine the steps run on, as their executor sees it, at ``t``."""

    t: float
    mem_total: int
    mem_available: int
    available: int
    """What the steps really have left: MemAvailable, or less where the cgroups they run under bind."""
    capacity: int | None = None
    """What ``available`` is left of: the limit of the cgroup that binds it, else (None) MemTotal."""

    @property
    def in_use(self) -> int:
        """Memory in use as ``free`` counts it: everything MemAvailable does not count as available."""
        return self.mem_total - self.mem_available

    @property
    def pool(self) -> int:
        """What the steps' memory is a share of: the binding cgroup's limit, else MemTotal."""
        return self.capacity or self.mem_total


@dataclass(frozen=True)
class AttemptRow:
    data: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def wall_s(self) -> float | None:
        end = self.data["ended_at"]
        return None if end is None else end - self.data["started_at"]

    @property
    def outputs(self) -> list[str] | None:
        """The outputs its step declared; None in a ledger written before they were recorded."""
        recorded = self.data.get("outputs")
        return None if recorded is None else json.loads(recorded)

    @property
    def fingerprint_parts(self) -> dict[str, Any] | None:
        """What its fingerprint was made of; None for a service's, or in a ledger written before."""
        recorded = self.data.get("fingerprint_parts")
        return None if recorded is None else json.loads(recorded)

    @property
    def replica(self) -> int | None:
        """Which replica of a service this attempt was; None for a step's."""
        return self.data.get("replica")

    @property
    def label(self) -> str:
        """How it is named where attempts are listed: its step, or its service and replica (``target[1]``)."""
        return self.step if self.replica is None else f"{self.step}[{self.replica}]"

    def as_json(self) -> dict[str, Any]:
        out = {k: self.data[k] for k in ATTEMPT_JSON_FIELDS}
        out["outputs"] = self.outputs
        out["replica"] = self.replica
        out["run_reason"] = self.data.get("run_reason")
        out["wall_s"] = self.wall_s
        out["stderr_tail"] = json.loads(self.data["stderr_tail"] or "[]")
        out["argv"] = json.loads(self.data["argv"])
        return out


class LedgerFull(sqlite3.OperationalError):
    """The ledger cannot be written for want of disk space, its reserve given back already: one
    line that says where and how much was free (a SQLite error, as what readers catch)."""


class LedgerUnreadable(RuntimeError):
    """The run directory's ledger is there, but SQLite cannot read it (not a database, damaged)."""


def unreadable_line(path: Path, exc: sqlite3.Error, fix: str) -> str:
    """One line for a ledger SQLite cannot read, and ``fix``: what to do about it."""
    return f"cannot read the ledger {path}: {exc} ({fix})"


def ledger_lost(run_dir: str | Path) -> str | None:
    """Why a ledger about to be created in ``run_dir`` starts without the history the folder had:
    its file is there but empty (0 bytes: SQLite would take it for a new database), or it is
    missing beside earlier attempts' logs; None when nothing is lost."""
    path = Path(run_dir) / LEDGER_NAME
    wal = path.with_name(f"{LEDGER_NAME}-wal")
    if path.is_file() and path.stat().st_size == 0 and not (wal.is_file() and wal.stat().st_size):
        return f"the ledger {path} was empty (0 bytes): whatever it held is lost; a new ledger starts there"
    logs = Path(run_dir) / STATE_DIR / "logs"
    if not path.exists() and logs.is_dir() and any(logs.iterdir()):
        return (
            f"no ledger in {Path(run_dir)}, though it holds earlier attempts' logs ({logs}): a new "
            "ledger starts there, without their history"
        )
    return None


def _no_room(path: Path) -> LedgerFull:
    """A run refused before it starts: its ledger, or the ledger's reserve, has no room."""
    return LedgerFull(
        f"no space left on device for the ledger {path}: {space_left(path.parent)}; free some space, "
        "then run again"
    )


def _full(path: Path, exc: sqlite3.Error) -> LedgerFull:
    return LedgerFull(
        f"no space left on device: the ledger {path} cannot be written ({exc}; {space_left(path.parent)});"
        " free some space, then rerun: the next run closes what this one could not record"
    )


class Ledger:
    def __init__(self, run_dir: str | Path, *, create: bool = True) -> None:
        self.path = Path(run_dir) / LEDGER_NAME
        if not create and not self.path.exists():
            raise FileNotFoundError(
                f"no ledger at {self.path}: run a pipeline with `eyrie run FILE --run-dir "
                f"{Path(run_dir)}` first, or pass the right --run-dir"
            )
        self._lock = threading.Lock()
        self._reserve = Path(run_dir) / STATE_DIR / "ledger-reserve"
        self._gave_back = False
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = _connect(self.path)
            try:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
                with self._lock:
                    self._db.executescript(_SCHEMA)
                    self._add_missing_columns()
            except sqlite3.DatabaseError as exc:
                self._db.close()
                if exc.sqlite_errorcode == sqlite3.SQLITE_FULL:
                    raise _no_room(self.path) from None
                fix = "move it aside to start a new ledger, its history kept there; or pass another --run-dir"
                raise LedgerUnreadable(unreadable_line(self.path, exc, fix)) from None
        else:
            self._db = _connect_read_only(self.path)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA busy_timeout=30000")

    def close(self) -> None:
        self._db.close()

    def _add_missing_columns(self) -> None:
        for table, columns in _ADDED_COLUMNS.items():
            present = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            for name, kind in columns.items():
                if name not in present:
                    try:
                        self._db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
                    except sqlite3.OperationalError as exc:
                        if "duplicate column" not in str(exc):
                            raise  # else another writer opening the same ledger added it first

    def _write(self, sql: str, params: tuple | dict = ()) -> sqlite3.Cursor:
        return self._room_made(lambda: self._db.execute(sql, params))

    def hold_reserve(self) -> None:
        """Set aside ``RESERVE_BYTES`` beside the ledger, in a file of its own, given back the first
        time a write finds the disk full: the verdicts of the attempts that filled it still get
        written. Raises LedgerFull when even that much is not free."""
        if self._reserve.is_file() and self._reserve.stat().st_size >= RESERVE_BYTES:
            return
        try:
            with open(self._reserve, "wb") as fh:
                fh.write(bytes(RESERVE_BYTES))  # written, not sparse: the blocks are really held
                os.fsync(fh.fileno())
        except OSError as exc:
            self._reserve.unlink(missing_ok=True)
            if exc.errno != errno.ENOSPC:
                raise
            raise _no_room(self.path) from None

    @property
    def reserve_given_back(self) -> bool:
        """Whether a write found the disk full and the reserve (``hold_reserve``) was given back."""
        return self._gave_back

    def _room_made(self, write: Callable[[], T]) -> T:
        """``write()`` under the lock; on a full disk, once more after the reserve is given back.
        LedgerFull when the disk is full still."""
        with self._lock:
            try:
                return self._or_rolled_back(write)
            except LedgerFull:
                if not self._reserve.is_file():
                    raise
                self._reserve.unlink()
                self._gave_back = True
            return self._or_rolled_back(write)

    def _or_rolled_back(self, write: Callable[[], T]) -> T:
        """``write()``; when it fails, a transaction it began is rolled back (SQLite may have done it
        already), and a full disk raises LedgerFull."""
        try:
            return write()
        except sqlite3.OperationalError as exc:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            if exc.sqlite_errorcode != sqlite3.SQLITE_FULL:
                raise
            raise _full(self.path, exc) from None

    # -- runs and step states ---------------------------------------------------------
    def start_run(
        self,
        run_id: str,
        pipeline: str,
        executor: str,
        steps: list[str],
        budget_bytes: int | None,
        budget_binding: str | None,
        *,
        host_sampled: bool = True,
    ) -> None:
        """``host_sampled``: False when the executor's steps run on machines this one cannot see."""
        self._write(
            "INSERT INTO runs (run_id, pipeline, started_at, state, orchestrator_pid, host, executor,"
            " budget_bytes, budget_binding, steps, host_sampled)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                run_id,
                pipeline,
                time.time(),
                RunState.RUNNING.value,
                os.getpid(),
                socket.gethostname(),
                executor,
                budget_bytes,
                budget_binding,
                json.dumps(steps),
                int(host_sampled),
            ),
        )
        for step in steps:
            self.set_step_state(run_id, step, StepState.PENDING)

    def end_run(self, run_id: str, state: RunState) -> None:
        ended = RunState(state).value
        self._write("UPDATE runs SET ended_at = ?, state = ? WHERE run_id = ?", (time.time(), ended, run_id))

    def set_step_state(self, run_id: str, step: str, state: StepState, detail: str = "") -> None:
        self._write(
            "INSERT INTO step_states (run_id, step, state, detail, updated_at) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT (run_id, step) DO UPDATE SET state = excluded.state,"
            " detail = excluded.detail, updated_at = excluded.updated_at",
            (run_id, step, StepState(state).value, detail, time.time()),
        )

    def runs(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._db.execute("SELECT * FROM runs ORDER BY started_at").fetchall()]

    def run(self, run_id: str) -> dict[str, Any] | None:
        row = self._db.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return dict(row) if row else None

    def latest_run(self) -> dict[str, Any] | None:
        row = self._db.execute("SELECT * FROM runs ORDER BY started_at DESC LIMIT 1").fetchone()
        return dict(row) if row else None

    def step_states(self, run_id: str) -> dict[str, dict[str, Any]]:
        rows = self._db.execute("SELECT * FROM step_states WHERE run_id = ?", (run_id,)).fetchall()
        return {r["step"]: dict(r) for r in rows}

    # -- attempts -----------------------------------------------------------------------
    def next_attempt_number(self, step: str) -> int:
        row = self._db.execute("SELECT MAX(attempt) FROM attempts WHERE step = ?", (step,)).fetchone()
        return (row[0] or 0) + 1

    def begin_attempt(
        self,
        *,
        run_id: str,
        step: str,
        attempt: int,
        executor: str,
        limit_bytes: int,
        limit_reason: str | None,
        argv: list[str],
        host_mem_available: int | None,
        host_mem_total: int | None,
        image: str | None,
        commit_id: str | None,
        outputs: list[str] | None = None,
        replica: int | None = None,
        run_reason: str | None = None,
        fingerprint_parts: dict[str, Any] | None = None,
    ) -> int:
        """``host_mem_*``: the memory the step's executor saw at its start (None: it runs on a machine
        this one does not see); ``outputs``: what the step declares it writes (None: it declares
        nothing, as a compile job); ``replica``: which replica of a service this is (None: a step);
        ``run_reason``: why the step runs; ``fingerprint_parts``: what its fingerprint is made of."""
        cursor = self._write(
            "INSERT INTO attempts (run_id, step, attempt, state, executor, orchestrator_pid,"
            " limit_bytes, limit_reason, started_at, host_mem_available, host_mem_total, image,"
            " commit_id, argv, outputs, replica, run_reason, fingerprint_parts)"
            " VALUES (?, ?, ?, 'running', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                run_id,
                step,
                attempt,
                executor,
                os.getpid(),
                limit_bytes,
                limit_reason,
                time.time(),
                host_mem_available,
                host_mem_total,
                image,
                commit_id,
                json.dumps(argv),
                None if outputs is None else json.dumps(outputs),
                replica,
                run_reason,
                None if fingerprint_parts is None else json.dumps(fingerprint_parts, sort_keys=True),
            ),
        )
        return int(cursor.lastrowid)

    def attempt_started(self, attempt_id: int, pid: int | None, location: str) -> None:
        self._write("UPDATE attempts SET pid = ?, location = ? WHERE id = ?", (pid, location, attempt_id))

    def end_attempt(
        self,
        attempt_id: int,
        *,
        verdict: str,
        reason: str,
        fields: dict[str, Any],
        timeline: list[tuple[float, int, int]],
    ) -> None:
        allowed = {
            "peak_bytes",
            "anon_peak_bytes",
            "oom_kills",
            "oom_kills_before",
            "oom_kills_after",
            "oom_at",
            "exit_code",
            "signal",
            "ended_at",
            "records",
            "stderr_tail",
            "started_at",
        }
        unknown = set(fields) - allowed
        if unknown:
            raise ValueError(f"not attempt fields: {sorted(unknown)}")
        assignments = ", ".join(f"{k} = :{k}" for k in fields)

        def write() -> None:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute(
                f"UPDATE attempts SET state = 'ended', verdict = :verdict, reason = :reason"
                f"{', ' if assignments else ''}{assignments} WHERE id = :id",
                {**fields, "verdict": verdict, "reason": reason, "id": attempt_id},
            )
            self._db.executemany(
                "INSERT INTO samples (attempt_id, t, total_bytes, anon_bytes) VALUES (?, ?, ?, ?)",
                [(attempt_id, t, total, anon) for t, total, anon in timeline],
            )
            self._db.execute("COMMIT")

        self._room_made(write)

    def attempts(self, step: str | None = None) -> list[AttemptRow]:
        sql, params = "SELECT * FROM attempts", ()
        if step is not None:
            sql, params = sql + " WHERE step = ?", (step,)
        rows = self._db.execute(sql + " ORDER BY started_at, id", params).fetchall()
        return [AttemptRow(dict(r)) for r in rows]

    def attempts_of(self, run_id: str) -> list[AttemptRow]:
        """One run's attempts, oldest first (as ``attempts``)."""
        rows = self._db.execute(
            "SELECT * FROM attempts WHERE run_id = ? ORDER BY started_at, id", (run_id,)
        ).fetchall()
        return [AttemptRow(dict(r)) for r in rows]

    def running_attempts(self) -> list[AttemptRow]:
        rows = self._db.execute("SELECT * FROM attempts WHERE state = 'running'").fetchall()
        return [AttemptRow(dict(r)) for r in rows]

    def reserve(self, attempt_id: int, reserved_bytes: int, expected_bytes: int | None, reason: str) -> None:
        """A compile job's reservation from now on: its first at admission, then each change."""
        self._write(
            "INSERT INTO reservations (attempt_id, t, reserved_bytes, expected_bytes, reason)"
            " VALUES (?, ?, ?, ?, ?)",
            (attempt_id, time.time(), reserved_bytes, expected_bytes, reason),
        )

    def reservations(self) -> dict[int, list[dict[str, Any]]]:
        """Every attempt's reservations in time order, by attempt id (none in a ledger from before them)."""
        try:
            rows = self._db.execute("SELECT * FROM reservations ORDER BY t, rowid").fetchall()
        except sqlite3.OperationalError as exc:  # a ledger written before reservations were recorded
            if "no such table" not in str(exc):
                raise
            return {}
        out: dict[int, list[dict[str, Any]]] = {}
        for row in rows:
            out.setdefault(row["attempt_id"], []).append(dict(row))
        return out

    def timeline(self, attempt_id: int) -> list[tuple[float, int, int]]:
        rows = self._db.execute(
            "SELECT t, total_bytes, anon_bytes FROM samples WHERE attempt_id = ? ORDER BY t",
            (attempt_id,),
        ).fetchall()
        return [tuple(r) for r in rows]

    # -- the host, and the runner's signs of life -----------------------------------------------
    def add_host_sample(self, run_id: str, sample: HostSample) -> None:
        self._write(
            "INSERT INTO host_samples (run_id, t, mem_total, mem_available, available, capacity)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (run_id, sample.t, sample.mem_total, sample.mem_available, sample.available, sample.capacity),
        )

    def heartbeat(self, run_id: str) -> None:
        """The runner is alive, in a second it wrote no host sample (its executor samples none)."""
        self._write("UPDATE runs SET heartbeat_at = ? WHERE run_id = ?", (time.time(), run_id))

    def host_samples(self, run_id: str) -> list[HostSample]:
        """The host's memory during a run, oldest first; none in a ledger written before it was sampled."""
        return self._host_samples("WHERE run_id = ? ORDER BY t", (run_id,))

    def last_host_sample(self, run_id: str) -> HostSample | None:
        return next(iter(self._host_samples("WHERE run_id = ? ORDER BY t DESC LIMIT 1", (run_id,))), None)

    def last_seen(self, run_id: str) -> float | None:
        """When the runner of a run last wrote a host sample or a heartbeat (once a second while it
        lives); None when it wrote neither, as runners did before either was recorded."""
        run = self._db.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        last = self.last_host_sample(run_id)
        signs = [
            *([run["heartbeat_at"]] if run is not None and "heartbeat_at" in run.keys() else []),
            *([last.t] if last is not None else []),
        ]
        return max((t for t in signs if t is not None), default=None)

    def _host_samples(self, where: str, params: tuple) -> list[HostSample]:
        if not self._has_table("host_samples"):
            return []
        rows = self._db.execute(f"SELECT * FROM host_samples {where}", params).fetchall()
        return [
            HostSample(
                r["t"],
                r["mem_total"],
                r["mem_available"],
                r["available"],
                r["capacity"] if "capacity" in r.keys() else None,
            )
            for r in rows
        ]

    def _has_table(self, name: str) -> bool:
        query = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
        return self._db.execute(query, (name,)).fetchone() is not None
