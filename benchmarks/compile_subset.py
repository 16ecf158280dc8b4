"""Compile chosen flash-attn translation units with the exact flags its setup.py gives nvcc.

Used to measure profiles, by the subset benchmark and by the slow tests: the
real setup.py runs once with ``PYTORCH_NVCC=/bin/false``, so torch's
cpp_extension writes its ninja file and the first compile fails at once; the
flags are read back from that file and a ninja file for the chosen files is
written with torch's own CUDA rule. ``nvcc`` in it is the real compiler or the
broker's stand-in.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def setup_ninja_variables(
    source: Path, python: str, cuda_home: Path, archs: str, threads: int, work: Path
) -> dict[str, str]:
    env = {
        **os.environ,
        "CUDA_HOME": str(cuda_home),
        "FLASH_ATTN_CUDA_ARCHS": archs,
        "NVCC_THREADS": str(threads),
        "MAX_JOBS": "1",
        "PYTORCH_NVCC": "/bin/false",
        "FLASH_ATTENTION_FORCE_BUILD": "TRUE",
    }
    temp = work / "setup-temp"
    done = subprocess.run(
        [python, "setup.py", "build_ext", "--build-temp", str(temp)],
        cwd=source,
        env=env,
        capture_output=True,
        text=True,
    )
    ninja_file = temp / "build.ninja"
    if not ninja_file.is_file():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(
            f"flash-attn's setup.py in {source} wrote no ninja file ({last}); "
            f"is it a flash-attn source tree, and does {python} import torch?"
        )
    out = {}
    for line in ninja_file.read_text().splitlines():
        if " = " in line and not line.startswith(" "):
            name, value = line.split(" = ", 1)
            out[name] = value
    return out


def torch_include(python: str) -> str:
    probe = subprocess.run(
        [python, "-c", "import torch.utils.cpp_extension as c; print(c.include_paths()[0])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return probe.stdout.strip()


def with_torch_headers_of(
    variables: dict[str, str], setup_python: str, headers_python: str
) -> dict[str, str]:
    """The same flags with another torch's headers.

    flash-attn 2.8.3 compiles with ``-std=c++17``; the headers of torch 2.14 need C++20
    (``operator<=>`` in c10), while a CUDA build of torch is what makes setup.py write
    its ninja file. The flags come from the one, the headers from the other.
    """
    old, new = torch_include(setup_python), torch_include(headers_python)
    return {k: v.replace(old, new) for k, v in variables.items()}


def torch_header_shim(python: str, work: Path) -> str:
    """Include flag for a header a CPU build of torch lacks, or "" when torch has it.

    CPU wheels of torch ship the c10/cuda headers but not the generated two-line
    ``c10/cuda/impl/cuda_cmake_macros.h`` they include.
    """
    if (Path(torch_include(python)) / "c10/cuda/impl/cuda_cmake_macros.h").is_file():
        return ""
    header = work / "shim" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    header.parent.mkdir(parents=True, exist_ok=True)
    header.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    return f"-I{work / 'shim'}"


def write_subset_ninja(
    build: Path, nvcc: str, variables: dict[str, str], source: Path, files: list[str], extra_include: str = ""
) -> None:
    lines = [
        "ninja_required_version = 1.3",
        f"nvcc = {nvcc}",
        f"cuda_cflags = {variables['cuda_cflags']} {extra_include}",
        f"cuda_post_cflags = {variables['cuda_post_cflags']}",
        "rule cuda_compile",
        "  command = $nvcc -MD -MF $out.d $cuda_cflags -c $in -o $out $cuda_post_cflags",
        "  depfile = $out.d",
        "  deps = gcc",
    ]
    lines += [
        f"build {build / Path(f).stem}.o: cuda_compile {source / 'csrc/flash_attn/src' / f}" for f in files
    ]
    build.mkdir(parents=True, exist_ok=True)
    (build / "build.ninja").write_text("\n".join(lines) + "\n")
