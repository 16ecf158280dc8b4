"""Atomic training checkpoints: a folder per step, written under a temporary name, then renamed.

A checkpoint counts only when its folder carries the ``COMPLETE`` marker, written
last inside the temporary folder before the rename: a ``kill -9`` at any moment
leaves either the previous checkpoint or the new one, never a torn one. The
temporary folder such a kill leaves behind is removed by the next save.

A checkpoint keeps what training changes: frozen parameters (the draft's copy of the
target's embedding) are rebuilt from the target on every start, not saved each time.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from pipeline.contract.atomic import atomic_path, final_name_of

COMPLETE = "COMPLETE"
_NAME = re.compile(r"^step-(\d{8})$")


def _folder_of(folder: Path, step: int) -> Path:
    return folder / f"step-{step:08d}"


def save(folder: Path, step: int, state: dict[str, Any], meta: dict[str, Any], keep: int = 2) -> Path:
    """Write ``state`` (tensors, optimizer, scheduler) and ``meta`` (JSON) as checkpoint ``step``."""
    final = _folder_of(folder, step)
    remove_leftovers(folder)
    with atomic_path(final) as tmp:
        tmp.mkdir()
        torch.save(
            {**state, "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}},
            tmp / "state.pt",
        )
        (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=2) + "\n")
        (tmp / COMPLETE).write_text("")
    for old in complete(folder)[:-keep]:
        shutil.rmtree(old)
    return final


def remove_leftovers(folder: Path) -> list[Path]:
    """Remove the temporary folders of writes that were killed; returns what was removed.

    Only one process writes a run's checkpoints (rank 0), so any temporary folder found
    before it writes is a dead write's.
    """
    if not folder.is_dir():
        return []
    leftovers = [p for p in folder.iterdir() if _NAME.match(final_name_of(p.name) or "") and p.is_dir()]
    for path in leftovers:
        shutil.rmtree(path)
    return leftovers


def trained_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state without its frozen parameters."""
    frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
    return {k: v for k, v in module.state_dict().items() if k not in frozen}


def restore(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a :func:`trained_state` into ``module``, whose frozen parameters are already in place."""
    frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [name for name in missing if name not in frozen]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the draft: missing {missing}, unexpected {unexpected}")


def complete(folder: Path) -> list[Path]:
    """Complete checkpoints, oldest first (leftover temporary folders are ignored)."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if _NAME.match(p.name) and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_step(folder: Path) -> int:
    """The step of the newest complete checkpoint; 0 if there is none."""
    found = complete(folder)
    return int(_NAME.match(found[-1].name).group(1)) if found else 0


def load(folder: Path, step: int) -> dict[str, Any] | None:
    """The state of checkpoint ``step``, RNG states restored; None if it is not complete."""
    path = _folder_of(folder, step)
    if not (path / COMPLETE).is_file():
        return None
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return state
