from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.compile.flash_attn import (
    BuildError,
    Plan,
    Toolchain,
    archs_for_compute_caps,
    auto_threads,
    build_env,
    cached_wheel,
    check_budget,
    cuda_sources,
    gpu_archs,
    parse_archs,
    plan_broker,
    source_version,
    toolchain,
)
from pipeline.compile.profile import Profile, ProfileEntry

GiB = 2**30
SETUP_PY = """
ext_modules.append(CUDAExtension(name="flash_attn_2_cuda", sources=[
    "csrc/flash_attn/flash_api.cpp",
    "csrc/flash_attn/src/flash_fwd_hdim32_fp16_sm80.cu",
    "csrc/flash_attn/src/flash_bwd_hdim128_bf16_sm80.cu",
]))
"""


def tree(tmp_path: Path) -> Path:
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text('__version__ = "2.8.3"\n')
    (tmp_path / "setup.py").write_text(SETUP_PY)
    return tmp_path


def plan(source: Path, budget: int, archs=("120",), threads=1) -> Plan:
    tools = Toolchain("python3", "2.13.0", "13.0", Path("/usr/local/cuda-13.0"), "13.0", "3.11")
    return Plan("2.8.3", source, archs, threads, budget, "test", tools, cpu_slots=2)


def test_compute_capabilities_map_to_flash_attn_archs() -> None:
    assert archs_for_compute_caps(["12.0", "10.0", "12.0"]) == ("100", "120")
    assert archs_for_compute_caps(["8.6", "9.0"]) == ("80", "90")
    with pytest.raises(BuildError, match="compute capability 7.5"):
        archs_for_compute_caps(["7.5"])


def test_auto_archs_without_gpus_asks_for_archs() -> None:
    with pytest.raises(BuildError, match=r"pass the archs, e.g. --archs '100;120'"):
        gpu_archs("/nonexistent/nvidia-smi")


def test_explicit_archs_are_checked() -> None:
    assert parse_archs("120;100") == ("100", "120")
    with pytest.raises(BuildError, match="flash-attn builds only 80;90;100;120"):
        parse_archs("75")


def test_sources_and_version_come_from_the_real_setup_files(tmp_path: Path) -> None:
    src = tree(tmp_path)
    assert cuda_sources(src) == ["flash_bwd_hdim128_bf16_sm80.cu", "flash_fwd_hdim32_fp16_sm80.cu"]
    assert source_version(src) == "2.8.3"


def test_cache_key_names_every_version_that_changes_the_wheel(tmp_path: Path) -> None:
    key = plan(tmp_path, GiB, archs=("100", "120")).cache_key
    assert key == "flash_attn-2.8.3-cp311-torch2.13.0-cuda13.0-nvcc13.0-sm100_120"
    assert cached_wheel(tmp_path, key) is None
    (tmp_path / key).mkdir()
    (tmp_path / key / "flash_attn-2.8.3-cp311-cp311-linux_x86_64.whl").write_bytes(b"")
    assert cached_wheel(tmp_path, key).name.startswith("flash_attn-2.8.3")


def test_a_wheel_cached_for_another_python_is_not_reused(tmp_path: Path) -> None:
    for_311 = plan(tmp_path, GiB)
    for_312 = replace(for_311, toolchain=replace(for_311.toolchain, python_version="3.12"))
    (tmp_path / for_311.cache_key).mkdir()
    (tmp_path / for_311.cache_key / "flash_attn-2.8.3-cp311-cp311-linux_x86_64.whl").write_bytes(b"")
    assert cached_wheel(tmp_path, for_312.cache_key) is None


def test_the_toolchain_names_the_python_the_wheel_is_built_for(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    nvcc.chmod(0o755)
    tools = toolchain(sys.executable, str(tmp_path))
    assert tools.python_version == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert tools.nvcc_version == "13.0"


def test_a_budget_below_the_largest_measured_job_is_refused_up_front(tmp_path: Path) -> None:
    src = tree(tmp_path)
    measured = ProfileEntry(
        "flash_bwd_hdim128_bf16_sm80.cu",
        ["120"],
        1,
        "13.0",
        anon_peak_bytes=6 * GiB,
        wall_s=120,
        package="flash-attn 2.8.3",
    )
    profile = Profile([measured], default_peak=8 * GiB)
    check_budget(plan(src, 7 * GiB), profile, cuda_sources(src))
    with pytest.raises(BuildError, match=r"5.00 GiB is below .* flash_bwd_hdim128_bf16_sm80.cu needs 6.00"):
        check_budget(plan(src, 5 * GiB), profile, cuda_sources(src))
    # Two archs at --threads 2 hold both per-arch compiles at once: 12 GiB.
    with pytest.raises(BuildError, match=r"needs 12.00 GiB for sm 100;120 with --threads 2"):
        check_budget(plan(src, 10 * GiB, ("100", "120"), 2), profile, cuda_sources(src))


def test_auto_threads_spends_memory_on_threads_only_when_it_is_plentiful() -> None:
    assert auto_threads(("100", "120"), budget=432 * GiB, cpus=128, per_arch_peak=8 * GiB) == 1
    assert auto_threads(("100", "120"), budget=432 * GiB, cpus=32, per_arch_peak=8 * GiB) == 2
    assert auto_threads(("120",), budget=12 * GiB, cpus=2, per_arch_peak=8 * GiB) == 1


def test_build_env_keeps_flash_attns_limiter_out_and_sends_nvcc_to_the_broker(tmp_path: Path) -> None:
    env = build_env(plan(tmp_path, GiB, ("100", "120"), 2), {"PYTORCH_NVCC": "wrapper"}, lookahead=8)
    assert env["MAX_JOBS"] == "8" and env["PYTORCH_NVCC"] == "wrapper"
    assert env["FLASH_ATTN_CUDA_ARCHS"] == "100;120" and env["NVCC_THREADS"] == "2"
    assert env["FLASH_ATTENTION_FORCE_BUILD"] == "TRUE"


def test_budget_auto_is_the_cgroup_aware_budget_less_headroom() -> None:
    from pipeline.compile.flash_attn import resolve_budget
    from pipeline.memory import memory_budget

    budget, basis, warnings = resolve_budget("auto", GiB)
    assert abs(budget - (memory_budget().available - GiB)) < 512 * 2**20  # usage moves meanwhile
    assert "headroom" in basis and warnings == []
    with pytest.raises(BuildError, match="less than the .* headroom"):
        resolve_budget("auto", 2**50)


def test_an_explicit_budget_is_checked_against_what_the_process_really_has() -> None:
    from pipeline.compile.flash_attn import resolve_budget
    from pipeline.memory import Budget

    has = Budget(
        available=20 * GiB,
        mem_total=64 * GiB,
        mem_available=30 * GiB,
        cgroup_version=2,
        binding="cgroup /sys/fs/cgroup/build (limit − usage)",
    )
    assert resolve_budget("12GiB", 2 * GiB, has) == (12 * GiB, "given with --budget", [])
    budget, _, warnings = resolve_budget("19GiB", 2 * GiB, has)
    assert budget == 19 * GiB and "leaves 1.00 GiB of the 20.00 GiB" in warnings[0]
    with pytest.raises(BuildError) as refused:
        resolve_budget("64GiB", 2 * GiB, has)
    message = str(refused.value)
    assert "--budget '64GiB' is more than this process has: 20.00 GiB (bound by cgroup" in message
    assert "pass at most 18.00 GiB (or auto" in message and "\n" not in message


def test_max_jobs_and_nvcc_threads_from_the_environment_are_used_and_said() -> None:
    from pipeline.compile.flash_attn import environment_settings

    assert environment_settings({}, "auto") == ("auto", None, [])
    threads, max_jobs, notes = environment_settings({"NVCC_THREADS": "2", "MAX_JOBS": "16"}, "auto")
    assert (threads, max_jobs) == ("2", 16)
    assert notes[0].startswith("NVCC_THREADS=2 (environment): nvcc --threads 2")
    assert notes[1].startswith("MAX_JOBS=16 (environment): at most 16 nvcc jobs at once")
    threads, _, notes = environment_settings({"NVCC_THREADS": "4"}, "1")
    assert threads == "1" and notes == ["--threads 1 given: NVCC_THREADS=4 (environment) is not used"]
    with pytest.raises(BuildError, match=r"MAX_JOBS='many' in the environment is not a positive number"):
        environment_settings({"MAX_JOBS": "many"}, "auto")


def test_a_prediction_cut_to_the_budget_is_said_with_the_margin_left(tmp_path: Path) -> None:
    src = tree(tmp_path)
    measured = ProfileEntry(
        "flash_bwd_hdim128_bf16_sm80.cu",
        ["120"],
        1,
        "13.0",
        anon_peak_bytes=6 * GiB,
        wall_s=120,
        package="flash-attn 2.8.3",
    )
    profile = Profile([measured], default_peak=8 * GiB, margin=1.15)
    assert check_budget(plan(src, 8 * GiB), profile, cuda_sources(src)) == []
    (note,) = check_budget(plan(src, int(6.6 * GiB)), profile, cuda_sources(src))
    assert "flash_bwd_hdim128_bf16_sm80.cu, predicted 6.90 GiB (6.00 GiB expected), gets 6.60 GiB" in note
    assert "1.10× its expected peak" in note


def test_torch_headers_that_need_cpp20_raise_a_cpp17_setup_to_cpp20(tmp_path: Path) -> None:
    from pipeline.compile.flash_attn import cxx_standard, write_cxx_shim

    (tmp_path / "src").mkdir()
    src = tree(tmp_path / "src")
    (src / "setup.py").write_text(SETUP_PY + 'nvcc_flags = ["-O3", "-std=c++17"]\n')
    older = plan(src, GiB)
    assert cxx_standard(replace(older, toolchain=replace(older.toolchain, torch="2.12.0"))) is None
    newer = replace(older, toolchain=replace(older.toolchain, torch="2.14.1+cu130"))
    assert cxx_standard(newer) == "c++20"

    # The host compiler torch's ninja file runs: -std=c++17 becomes -std=c++20, the rest untouched.
    shim = write_cxx_shim(tmp_path, "c++20")
    probe = subprocess.run(
        [str(shim), "-std=c++17", "-x", "c++", "-dM", "-E", "-D", "ARG=a b", "-"],
        input="",
        capture_output=True,
        text=True,
        check=True,
    )
    assert "#define __cplusplus 202002L" in probe.stdout
    assert "#define ARG a b" in probe.stdout


def test_broker_raises_the_standard_of_nvcc_commands() -> None:
    from pipeline.compile.broker import with_standard

    argv = ["-O3", "-std=c++17", "-c", "a.cu"]
    assert with_standard(argv, "c++20") == ["-O3", "-std=c++20", "-c", "a.cu"]
    assert with_standard(argv, None) == argv


def test_the_broker_of_a_plan_runs_its_nvcc_for_its_package_within_its_budget(tmp_path: Path) -> None:
    build = plan(tmp_path, 16 * GiB)
    profile = Profile([], default_peak=GiB)
    broker = plan_broker(build, profile=profile, run_dir=tmp_path, cxx_standard="c++20")
    try:
        assert broker.nvcc == "/usr/local/cuda-13.0/bin/nvcc" and broker.nvcc_version == "13.0"
        assert broker.package == "flash-attn 2.8.3" and broker.cxx_standard == "c++20"
        assert broker.budget == broker.scheduler.budget == 16 * GiB and broker.scheduler.cpu_slots == 2
    finally:  # never started: only its ledger and socket folder exist
        broker.ledger.close()
        os.rmdir(broker._socket_dir)
