"""`make demo` ends by saying how to run eyrie next: the venv's eyrie is not on PATH."""

from __future__ import annotations

import shutil
import subprocess
import tomllib

import pytest

from eyrie_testing import REPO


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_ends_by_saying_how_to_run_eyrie():
    # -n: the recipe as make would run it, nothing run; the venv is taken as installed.
    dry = subprocess.run(
        [
            "make",
            "-n",
            "-o",
            "venv",
            "-o",
            ".venv/.installed-dev,ml,generate,docker,provision,quantized",
            "demo",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    ).stdout.splitlines()
    status = next(i for i, line in enumerate(dry) if "eyrie status --run-dir runs/demo" in line)
    after = "\n".join(dry[status + 1 :])
    assert ".venv/bin/eyrie explain train --run-dir runs/demo" in after
    assert "source .venv/bin/activate" in after


def _dry_images(*settings: str) -> list[str]:
    return subprocess.run(
        [
            "make",
            "-n",
            "-o",
            "venv",
            "-o",
            ".venv/.installed-dev,ml,generate,docker,provision,quantized",
            "images",
            *settings,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    ).stdout.splitlines()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_images_on_a_gpu_host_builds_flash_attn_first_once_per_version_archs_torch_and_cuda(tmp_path):
    dry = _dry_images("GPU_HOST=yes")
    wheel_build = next(i for i, line in enumerate(dry) if "--target wheel" in line)
    pipeline_image = next(i for i, line in enumerate(dry) if "-t eyrie-pipeline:" in line)
    assert wheel_build < pipeline_image  # the image then holds the wheel
    assert "dest=build/flash-attn/2.8.3-sm100-120-torch-2.13.0-cu130 " in dry[wheel_build + 1]
    # Built already for that version, archs, torch and CUDA: not built again.
    folder = tmp_path / "2.8.3-sm100-120-torch-2.13.0-cu130"
    folder.mkdir()
    (folder / "flash_attn-2.8.3-cp312-cp312-linux_x86_64.whl").write_bytes(b"")
    built_already = _dry_images("GPU_HOST=yes", f"FLASH_ATTN_WHEELS={folder}")
    assert not any("--target wheel" in line for line in built_already)
    # Another torch is another folder, so another build.
    other = _dry_images("GPU_HOST=yes", "TORCH_SPEC=torch==2.14.1")
    assert any("dest=build/flash-attn/2.8.3-sm100-120-torch-2.14.1-cu130 " in line for line in other)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_images_without_a_gpu_says_the_image_has_no_flash_attn():
    dry = _dry_images("GPU_HOST=")
    assert not any("--target wheel" in line for line in dry)
    assert any("the image is built without flash-attn" in line for line in dry)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_images_gives_both_wheelhouses_the_bench_extra_to_take_without_dependencies():
    bench = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["bench"]
    dry = "\n".join(_dry_images("GPU_HOST=")).replace("\\\n", " ")
    calls = [line for line in dry.splitlines() if "images/wheelhouse.sh" in line]
    assert [line.split("images/wheelhouse.sh ")[1].split()[0] for line in calls] == [
        "build/images/pipeline",
        "build/images/sglang",
    ]
    for line in calls:
        assert f'WHEELHOUSE_NO_DEPS="{" ".join(bench)}"' in line, line
