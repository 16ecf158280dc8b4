"""`eyrie build flash-attn` answers a wrong option or file with one line naming it, not a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import pipeline.compile.cli as build_cli
import pipeline.compile.flash_attn as flash_attn
from pipeline.cli import app
from pipeline.compile.flash_attn import Toolchain
from pipeline.memory import Budget

GiB = 2**30


def flash_attn_tree(root: Path) -> Path:
    (root / "flash_attn").mkdir(parents=True)
    (root / "flash_attn" / "__init__.py").write_text('__version__ = "2.8.3"\n')
    (root / "setup.py").write_text('sources=["csrc/flash_attn/src/flash_fwd_hdim32_fp16_sm80.cu"]\n')
    return root


@pytest.fixture
def build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Runs the command on a flash-attn tree, with a toolchain no profile has measured (no nvcc needed),
    in a process that has 20 GiB."""
    tools = Toolchain("python3", "2.13.0", "13.0", Path("/usr/local/cuda"), "99.9", "3.11")
    monkeypatch.setattr(build_cli, "toolchain", lambda python, cuda_home: tools)
    has = Budget(available=20 * GiB, mem_total=64 * GiB, mem_available=30 * GiB, cgroup_version=2)
    monkeypatch.setattr(flash_attn, "memory_budget", lambda: has)
    for variable in ("MAX_JOBS", "NVCC_THREADS"):
        monkeypatch.delenv(variable, raising=False)
    source = flash_attn_tree(tmp_path / "src")

    def run(*args: str):
        options = {
            "--source": str(source),
            "--archs": "120",
            "--threads": "1",
            "--budget": "8GiB",
            "--out-dir": str(tmp_path / "out"),
        }
        for option, value in zip(args[::2], args[1::2], strict=True):
            options[option] = value
        return CliRunner().invoke(app, ["build", "flash-attn", *(x for kv in options.items() for x in kv)])

    return run


@pytest.mark.parametrize(
    ("option", "value", "named"),
    [
        ("--budget", "4GB2", "--budget '4GB2'"),
        ("--budget", "0", "--budget '0'"),
        ("--headroom", "x", "--headroom 'x'"),
        ("--source", "{tmp}", "{tmp} is not a flash-attn source tree"),
        ("--profile", "{tmp}/missing.json", "{tmp}/missing.json"),
        ("--profile", "{tmp}/malformed.json", "{tmp}/malformed.json"),
        ("--profile", "{tmp}/no_entries.json", "{tmp}/no_entries.json"),
        ("--archs", "75;120", "--archs '75;120': flash-attn builds only 80;90;100;120"),
        ("--budget", "64GiB", "--budget '64GiB' is more than this process has: 20.00 GiB"),
        # 3.32 GiB with nvcc 13.0, 3.13 with 13.1: the nearest toolchain's figure stands for 99.9's.
        (
            "--budget",
            "1GiB",
            "budget 1.00 GiB is below the expected peak of one job: "
            "flash_fwd_hdim32_fp16_sm80.cu needs 3.13 GiB for sm 120",
        ),
    ],
)
def test_a_wrong_option_or_file_is_one_line_naming_it(
    tmp_path: Path, build, option: str, value: str, named: str
) -> None:
    (tmp_path / "malformed.json").write_text('{"entries": [\n')
    (tmp_path / "no_entries.json").write_text('{"note": "measured by hand"}\n')
    result = build(option, value.format(tmp=tmp_path))
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), (
        result.exception
    )
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert named.format(tmp=tmp_path) in lines[0]


def test_a_budget_below_one_job_is_its_error_alone(build, monkeypatch: pytest.MonkeyPatch) -> None:
    # 1 GiB of a process that has 2.5: within auto's headroom, which once printed a note first.
    has = Budget(available=int(2.5 * GiB), mem_total=64 * GiB, mem_available=30 * GiB, cgroup_version=2)
    monkeypatch.setattr(flash_attn, "memory_budget", lambda: has)
    result = build("--budget", "1GiB")
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: budget 1.00 GiB is below"), result.output
