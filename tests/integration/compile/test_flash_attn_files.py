"""Two real flash-attn 2.8.3 translation units through the scheduler (slow: minutes each).

Needs the flash-attn sdist (fetched from PyPI into .eyrie/src once) and a Python
with a CUDA build of torch for setup.py to write its ninja file: set
EYRIE_TORCH_CUDA_PYTHON (e.g. a venv with `pip install torch==2.14.1`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.compile_subset import (
    setup_ninja_variables,
    torch_header_shim,
    with_torch_headers_of,
    write_subset_ninja,
)
from eyrie_testing import REPO
from pipeline.compile.broker import BuildBroker
from pipeline.compile.flash_attn import DEFAULT_JOB_PEAK_PER_ARCH, fetch_sdist
from pipeline.compile.profile import SHIPPED_PROFILES, JobKey, Profile
from pipeline.run.ledger import Ledger

CUDA_HOME = Path("/usr/local/cuda-13.0")
TORCH_CUDA_PYTHON = os.environ.get("EYRIE_TORCH_CUDA_PYTHON")
FILES = ["flash_fwd_hdim128_bf16_sm80.cu", "flash_fwd_split_hdim128_bf16_sm80.cu"]
GiB = 2**30
PKG = "flash-attn 2.8.3"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("real_cgroups"),
    pytest.mark.skipif(not (CUDA_HOME / "bin/nvcc").is_file(), reason=f"needs nvcc in {CUDA_HOME}"),
    pytest.mark.skipif(not TORCH_CUDA_PYTHON, reason="set EYRIE_TORCH_CUDA_PYTHON to a CUDA torch's Python"),
    pytest.mark.timeout(3600),
]


def test_two_flash_attn_files_compile_side_by_side_within_the_budget(tmp_path: Path) -> None:
    source = fetch_sdist("2.8.3", REPO / ".eyrie" / "src", sys.executable)
    variables = setup_ninja_variables(source, TORCH_CUDA_PYTHON, CUDA_HOME, "120", 1, tmp_path)
    variables = with_torch_headers_of(variables, TORCH_CUDA_PYTHON, sys.executable)
    profile = Profile.load([SHIPPED_PROFILES], default_peak=DEFAULT_JOB_PEAK_PER_ARCH)
    budget = 10 * GiB  # both measured forward files (~4.1 GiB each, +15%) fit side by side
    with BuildBroker(
        nvcc=str(CUDA_HOME / "bin/nvcc"),
        nvcc_version="13.0",
        package=PKG,
        profile=profile,
        budget=budget,
        cpu_slots=2,
        run_dir=tmp_path / "run",
    ) as broker:
        write_subset_ninja(
            tmp_path / "build",
            broker.env()["PYTORCH_NVCC"],
            variables,
            source,
            FILES,
            torch_header_shim(sys.executable, tmp_path),
        )
        done = subprocess.run(
            ["ninja", "-j", "2"],
            cwd=tmp_path / "build",
            env={**os.environ, **broker.env()},
            capture_output=True,
            text=True,
        )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert broker.report().oom_kills == 0
    rows = Ledger(tmp_path / "run", create=False).attempts()
    assert {r.verdict for r in rows} == {"succeeded"} and len(rows) == 2
    first, second = sorted((r.started_at, r.ended_at) for r in rows)
    assert second[0] < first[1], "the two predicted peaks fit the budget together: they overlap"
    shipped = Profile.load([SHIPPED_PROFILES], default_peak=1, margin=1.0)
    for row in rows:
        measured = shipped.predict(JobKey(row.step, ("120",), 1, "13.0", PKG))
        assert 0.75 < row.anon_peak_bytes / measured.peak_bytes < 1.25, (row.step, row.anon_peak_bytes)
