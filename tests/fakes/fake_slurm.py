"""A test fake of Slurm's commands (sbatch, squeue, scontrol, sacct, scancel, sinfo), for faults a
real cluster cannot be made to show on demand: a controller that does not answer, an sbatch that
hangs after its job was queued, a scancel that does not end the job.

Run as ``python fake_slurm.py COMMAND ARGS…`` (the wrappers ``FakeSlurm`` puts on PATH do that); the
cluster is a JSON file (``$FAKE_SLURM_STATE``): jobs by id, and switches for the faults (``down``:
every command, or a list of those, cannot reach the controller). Every call is logged there. Jobs
never run: a test sets their states.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

UNREACHABLE = "Unable to contact slurm controller (connect failure)"
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")


class FakeSlurm:
    """The fake cluster of one test: its commands on PATH, its state in a file."""

    def __init__(self, root: Path) -> None:
        self.bin = root / "fake-slurm-bin"
        self.bin.mkdir(parents=True)
        self.state_path = root / "fake-slurm.json"
        self.state_path.write_text(
            json.dumps(
                {
                    "down": False,
                    "sbatch": "ok",
                    "scancel_ends_jobs": True,
                    "next_id": 800,
                    "jobs": {},
                    "calls": [],
                    "partitions": {"debug": [["node1", os.uname().nodename, 8192]]},
                }
            )
        )
        for command in ("sbatch", "squeue", "scontrol", "sacct", "scancel", "sinfo"):
            wrapper = self.bin / command
            wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {__file__} {command} "$@"\n')
            wrapper.chmod(0o755)

    @property
    def env(self) -> dict[str, str]:
        path = f"{self.bin}{os.pathsep}{os.environ['PATH']}"
        return {"PATH": path, "FAKE_SLURM_STATE": str(self.state_path)}

    @contextmanager
    def changing(self):
        with _locked(self.state_path) as state:
            yield state

    def set(self, **switches) -> None:
        with self.changing() as state:
            state.update(switches)

    def add_job(self, job_id: str, state: str, name: str = "eyrie-r1-train-2", exit_code: str = "0:0"):
        with self.changing() as cluster:
            cluster["jobs"][job_id] = {"name": name, "state": state, "exit": exit_code}

    def job(self, job_id: str) -> dict:
        return json.loads(self.state_path.read_text())["jobs"][job_id]

    def calls(self, command: str) -> list[list[str]]:
        return [c[1:] for c in json.loads(self.state_path.read_text())["calls"] if c[0] == command]


@contextmanager
def _locked(path: Path):
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = json.loads(path.read_text())
        yield state
        path.write_text(json.dumps(state))


def _option(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(args):
            return args[i + 1]
    return None


def _format(fmt: str, job_id: str, job: dict) -> str:
    return fmt.replace("%i", job_id).replace("%T", job["state"]).replace("%j", job["name"])


def main(command: str, args: list[str]) -> int:
    with _locked(Path(os.environ["FAKE_SLURM_STATE"])) as state:
        state["calls"].append([command, *args])
        if state["down"] is True or command in (state["down"] or ()):
            print(f"{command}: error: {UNREACHABLE}", file=sys.stderr)
            return 1
        jobs = state["jobs"]
        if command == "sbatch":
            if state["sbatch"] == "refuse":
                print("sbatch: error: Batch job submission failed: Invalid partition name", file=sys.stderr)
                return 1
            if state["sbatch"] != "hang":  # "hang_after_queueing": the job is queued, the answer lost
                job_id = str(state["next_id"])
                state["next_id"] += 1
                jobs[job_id] = {"name": _option(args, "--job-name"), "state": "RUNNING", "exit": "0:0"}
            hang = state["sbatch"] in ("hang", "hang_after_queueing")
            if not hang:
                print(job_id)
                return 0
        elif command == "squeue":
            fmt = _option(args, "-o") or "%i %T"
            if (ids := _option(args, "-j")) is not None:
                listed = [i for i in ids.split(",") if i in jobs]
                if not listed:
                    print("slurm_load_jobs error: Invalid job id specified", file=sys.stderr)
                    return 1
            else:
                name = _option(args, "--name")
                listed = [i for i, job in jobs.items() if name is None or job["name"] == name]
            print("\n".join(_format(fmt, i, jobs[i]) for i in listed))
            return 0
        elif command == "scontrol":
            job_id = args[-1]
            if job_id not in jobs:
                print("slurm_load_jobs error: Invalid job id specified", file=sys.stderr)
                return 1
            job = jobs[job_id]
            print(f"JobId={job_id} JobName={job['name']} JobState={job['state']} ExitCode={job['exit']}")
            return 0
        elif command == "sacct":
            print("sacct: error: Slurm accounting storage is disabled", file=sys.stderr)
            return 1
        elif command == "scancel":
            job = jobs.get(args[-1])
            if job and state["scancel_ends_jobs"] and job["state"] in ACTIVE:
                job["state"] = "CANCELLED"
            return 0
        elif command == "sinfo":
            partitions = state["partitions"]
            if _option(args, "-o") == "%P":
                print("\n".join(name + ("*" if i == 0 else "") for i, name in enumerate(partitions)))
            else:
                wanted = (_option(args, "-p") or next(iter(partitions))).split(",")
                # A node is [name, hostname, memory MiB] and, with GPUs, its Gres.
                nodes = [[*node, "(null)"][:4] for p in wanted for node in partitions.get(p, [])]
                print("\n".join("|".join(map(str, node)) for node in nodes))
            return 0
    time.sleep(3600)  # a command that hangs: the caller's timeout ends it
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
