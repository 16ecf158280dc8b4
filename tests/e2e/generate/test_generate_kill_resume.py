"""kill -9 the generation step at random moments, rerun: every prompt id exactly once."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from collections import Counter

import pytest
from generate_helpers import (
    REPO,
    fake_servers,
    generate_argv,
    read_jsonl,
    run_generate,
    simple_prompts,
)

from pipeline.contract.step import check_manifest

TRIALS = 6
ROWS = 3000


@pytest.fixture
def fake_server():
    yield from fake_servers()


def complete_ids(path) -> list[str]:
    """Ids of the newline-terminated lines: the rows a rerun counts as done."""
    if not path.exists():
        return []
    data = path.read_bytes()
    return [json.loads(line)["id"] for line in data[: data.rfind(b"\n") + 1].splitlines()]


def wait_for_rows(path, rows: int, process: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        if path.exists() and path.read_bytes().count(b"\n") >= rows:
            return
        time.sleep(0.01)
    raise AssertionError(f"the step wrote fewer than {rows} rows (exit {process.poll()})")


def test_kill_9_at_random_points_then_rerun_yields_each_id_exactly_once(tmp_path, fake_server):
    # At most ~160 rows/s (8 in flight, 50 ms each), so no trial can finish before its kill;
    # faults so that kills also land mid-retry.
    server = fake_server(
        "--slow-rate", "1", "--slow-s", "0.05", "--error-rate", "500:0.05", "--drop-rate", "0.02"
    )
    prompts = simple_prompts(tmp_path / "prompts.jsonl", ROWS)
    out = tmp_path / "out"
    partial = out / "conversations.partial.jsonl"
    rng = random.Random(20261129)
    mid_run = 0
    for trial in range(TRIALS):
        before = len(complete_ids(partial))
        process = subprocess.Popen(
            generate_argv(prompts, out, server.url, extra=("--concurrency", "8")),
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if trial == 0:
            time.sleep(rng.uniform(0.1, 1.0))  # during startup or the health wait
        else:
            # Once a random number of rows more is on disk, then at a random moment between flushes.
            wait_for_rows(partial, before + rng.randint(1, 400), process)
            time.sleep(rng.uniform(0, 0.5))
        process.send_signal(signal.SIGKILL)
        process.wait()
        complete = complete_ids(partial)
        assert len(complete) == len(set(complete)), "a row was written twice"
        mid_run += before < len(complete) < ROWS
    assert mid_run >= TRIALS - 1, "the kills did not land while rows were being written"
    # What a kill inside write(2) would leave: half a row with no newline.
    torn = b'{"id": "p00001", "source": "test", "conversations": [{"ro'
    with open(partial, "ab") as fh:
        fh.write(torn)

    result = run_generate(prompts, out, server.url, extra=("--concurrency", "16"))
    assert result.returncode == 0, result.stderr
    assert f"cut a torn last line of {len(torn)} bytes" in result.stderr
    ids = Counter(row["id"] for row in read_jsonl(out / "conversations.jsonl"))
    assert set(ids) == {f"p{i:05d}" for i in range(ROWS)}
    assert max(ids.values()) == 1
    ok, why = check_manifest(out, ["conversations.jsonl", "errors.jsonl"])
    assert ok, why
    assert not partial.exists()


def test_sigterm_stops_cleanly_keeps_rows_and_a_rerun_finishes(tmp_path, fake_server):
    server = fake_server("--slow-rate", "1", "--slow-s", "0.05")
    prompts = simple_prompts(tmp_path / "prompts.jsonl", 2000)
    out = tmp_path / "out"
    partial = out / "conversations.partial.jsonl"
    process = subprocess.Popen(
        generate_argv(prompts, out, server.url, extra=("--concurrency", "8")),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_rows(partial, 100, process)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM
    assert "interrupted; rows done so far are kept" in stderr and "Traceback" not in stderr
    kept = complete_ids(partial)
    # Rows answered before the signal were flushed on the way out, whole lines only.
    assert len(kept) >= 100 and partial.read_bytes().endswith(b"\n")
    result = run_generate(prompts, out, server.url, extra=("--concurrency", "16"))
    assert result.returncode == 0, result.stderr
    assert f"{len(kept)} already done" in result.stderr
    ids = Counter(row["id"] for row in read_jsonl(out / "conversations.jsonl"))
    assert len(ids) == 2000 and max(ids.values()) == 1
