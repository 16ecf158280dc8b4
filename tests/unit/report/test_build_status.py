"""`eyrie status` on a build run: each compile job's predicted peak beside its measured one."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from pipeline.report.status import status_command
from pipeline.run.ledger import LEDGER_NAME, Ledger

GiB = 2**30


def build_ledger(run_dir: Path) -> None:
    ledger = Ledger(run_dir)
    ledger.start_run("build-1", "eyrie build", "local", [], 16 * GiB, "build budget")
    jobs = [  # name, expected, reservations, measured peak
        ("flash_bwd_hdim128_bf16_sm80.cu", 6 * GiB, [7 * GiB, 2 * GiB], int(6.3 * GiB)),
        ("flash_fwd_hdim64_fp16_sm80.cu", None, [8 * GiB], int(3.5 * GiB)),
    ]
    for name, expected, held, peak in jobs:
        attempt = ledger.begin_attempt(
            run_id="build-1",
            step=name,
            attempt=1,
            executor="local",
            limit_bytes=held[0],
            limit_reason="measured 6.00 GiB × 1.15 margin" if expected else "unmeasured file: default",
            argv=["nvcc"],
            host_mem_available=20 * GiB,
            host_mem_total=24 * GiB,
            image=None,
            commit_id=None,
        )
        ledger.reserve(attempt, held[0], expected, "admitted")
        for later in held[1:]:
            ledger.reserve(attempt, later, later, "peak passed")
        ledger.end_attempt(
            attempt,
            verdict="succeeded",
            reason="exit 0",
            fields={"exit_code": 0, "anon_peak_bytes": peak},
            timeline=[],
        )
    ledger.end_run("build-1", "succeeded")
    ledger.close()


def test_status_lists_predicted_and_measured_peaks_side_by_side(tmp_path: Path, capsys) -> None:
    build_ledger(tmp_path)
    assert status_command(tmp_path, tmp_path, json_output=False) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "predicted peak" in line)
    columns = [header.index(name) for name in ("predicted peak", "measured peak", "measured / predicted")]
    assert columns == sorted(columns)
    bwd = next(line for line in out.splitlines() if "flash_bwd_hdim128" in line)
    assert "6.00 GiB" in bwd and "6.30 GiB" in bwd and "1.05" in bwd and "7.00 GiB → 2.00 GiB" in bwd
    fwd = next(line for line in out.splitlines() if "flash_fwd_hdim64" in line)
    assert "default" in fwd and "3.50 GiB" in fwd


def test_status_json_carries_each_jobs_reservations(tmp_path: Path, capsys) -> None:
    build_ledger(tmp_path)
    assert status_command(tmp_path, tmp_path, json_output=True) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    held = rows["flash_bwd_hdim128_bf16_sm80.cu"]["reservations"]
    assert [r["reserved_bytes"] for r in held] == [7 * GiB, 2 * GiB]
    assert held[0]["expected_bytes"] == 6 * GiB and held[0]["t"] <= held[1]["t"]


def test_a_ledger_from_before_reservations_were_recorded_still_reads(tmp_path: Path) -> None:
    build_ledger(tmp_path)
    with sqlite3.connect(tmp_path / LEDGER_NAME) as db:
        db.execute("DROP TABLE reservations")
    reader = Ledger(tmp_path, create=False)
    try:
        assert reader.reservations() == {}
        assert len(reader.attempts()) == 2
    finally:
        reader.close()
