"""Processes that end in each way the verdict table knows, for real.

Run as a step by eyrie (cwd = the step directory): ``python scenario.py NAME``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

from pipeline.contract.atomic import atomic_path
from pipeline.contract.step import step_dir_from_env, write_manifest

MIB = 1024 * 1024


def allocate_forever() -> None:
    chunks = []
    while True:
        chunks.append(b"\x01" * (8 * MIB))  # written, so every page is charged


def succeed() -> None:
    with atomic_path("result.txt") as tmp:
        tmp.write_text("done\n")


def oom() -> None:
    allocate_forever()


def child_oom() -> None:
    child = subprocess.run([sys.executable, __file__, "oom"])
    print(f"child ended with {child.returncode}; the parent carries on and exits 0")


def write_then_abort() -> None:
    with atomic_path("result.txt") as tmp:
        tmp.write_text("done\n")
    write_manifest(step_dir_from_env(), ["result.txt"])
    sys.stdout.flush()
    os.abort()  # as pyarrow does at interpreter shutdown, after all the work


def segfault() -> None:
    ctypes.string_at(0)


def exception() -> None:
    raise ValueError("row 17: field 'messages' is not a list")


def sleep() -> None:
    time.sleep(600)


def killed_from_outside() -> None:
    # Another process (not the OOM killer) sends SIGKILL: exit 137 without any OOM.
    subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -9 {os.getpid()}"])
    time.sleep(600)


def allocate() -> None:
    """Hold ``sys.argv[2]`` MiB for a moment, then succeed: fits or not, depending on the limit."""
    held = [b"\x01" * MIB for _ in range(int(sys.argv[2]))]
    time.sleep(0.2)
    with atomic_path("result.txt") as tmp:
        tmp.write_text(f"held {len(held)} MiB\n")


def hold() -> None:
    """Hold ``sys.argv[2]`` MiB for ``sys.argv[3]`` seconds, then end as scenario ``sys.argv[4]``
    (default: succeed) with the memory still held: a server beside the others, a job that dies."""
    held = [b"\x01" * MIB for _ in range(int(sys.argv[2]))]
    time.sleep(float(sys.argv[3]))
    SCENARIOS[sys.argv[4] if len(sys.argv) > 4 else "succeed"]()
    del held


def thrash() -> None:
    """Hold ``sys.argv[2]`` MiB and read a 64 MiB file over and over for ``sys.argv[3]`` seconds,
    then succeed. Under a limit a little above the held memory the page cache cannot keep the
    file, so each pass reads it back in from disk: reclaim always frees a page, and the kernel
    never OOM-kills it."""
    import mmap

    pages = "pages.bin"
    with open(pages, "wb") as out:
        out.write(os.urandom(64 * MIB))
        os.fsync(out.fileno())
    held = bytearray(int(sys.argv[2]) * MIB)
    held[::4096] = b"\x01" * len(range(0, len(held), 4096))  # written, so every page is charged
    deadline = time.monotonic() + float(sys.argv[3])
    with open(pages, "rb") as data, mmap.mmap(data.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        while time.monotonic() < deadline:
            sum(mapped[offset] for offset in range(0, len(mapped), 4096))
    succeed()


def memory_error() -> None:
    bytearray(1 << 50)  # 1 PiB: malloc refuses at once, no page is touched, nothing is killed


SCENARIOS = {
    f.__name__: f
    for f in (
        succeed,
        oom,
        child_oom,
        write_then_abort,
        segfault,
        exception,
        sleep,
        killed_from_outside,
        memory_error,
        allocate,
        hold,
        thrash,
    )
}

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    SCENARIOS[sys.argv[1]]()
