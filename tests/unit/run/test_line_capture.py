"""A step's output, read to its end: the lines still in its pipe when it ends are in the tail."""

from __future__ import annotations

import os
import time

from pipeline.run.executor import LineCapture


def test_the_tail_ends_with_the_streams_last_line_however_long_the_drain_takes(tmp_path):
    """300 lines, each taking the line sink 10 ms: 3 s of draining, longer than the second of
    silence that ends a wait."""
    read, write = os.pipe()
    with os.fdopen(write, "wb") as pipe:
        pipe.write(b"".join(f"{n}\n".encode() for n in range(1, 301)))  # fits the pipe's buffer
    capture = LineCapture(
        os.fdopen(read, "rb"), tmp_path / "stderr.log", "stderr", lambda _n, _l: time.sleep(0.01)
    )
    capture.join(1)
    assert capture.tail[-1] == "300"
    assert (tmp_path / "stderr.log").read_text().splitlines()[-1] == "300"


def test_a_pipe_held_open_and_silent_ends_the_wait(tmp_path):
    read, write = os.pipe()
    os.write(write, b"first\n")
    capture = LineCapture(os.fdopen(read, "rb"), tmp_path / "stderr.log", "stderr", None)
    started = time.monotonic()
    capture.join(0.5)
    assert capture.tail == ["first"] and time.monotonic() - started < 5
    os.close(write)
