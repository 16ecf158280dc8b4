"""Several processes resume together: from rank 0's checkpoint, or not at all with a clear reason."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.steps.train import checkpoint as ckpt
from pipeline.steps.train.loop import resume


def _resume_in_rank(rank: int, world: int, init_file: str, folders: list[str], out: str) -> None:
    from pathlib import Path

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        step, state = resume(Path(folders[rank]), rank, world, torch.device("cpu"))
        result = {"step": step, "weight": state["draft"]["w"].tolist() if state else None}
    except ValueError as exc:
        result = {"error": str(exc)}
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def run_ranks(tmp_path, folders) -> list[dict]:
    mp.spawn(
        _resume_in_rank,
        args=(len(folders), str(tmp_path / "init"), [str(f) for f in folders], str(tmp_path)),
        nprocs=len(folders),
    )
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(len(folders))]


def save(folder, step: int, weight: float) -> None:
    ckpt.save(folder, step, {"draft": {"w": torch.tensor([weight])}}, {"total_steps": 10})


@pytest.mark.timeout(120)
def test_every_rank_resumes_from_rank_0s_newest_checkpoint(tmp_path):
    shared = tmp_path / "shared"
    save(shared, 4, 4.0)
    save(shared, 6, 6.0)
    assert run_ranks(tmp_path, [shared, shared]) == [{"step": 6, "weight": [6.0]}] * 2


@pytest.mark.timeout(120)
def test_a_rank_that_cannot_see_rank_0s_checkpoint_says_the_folder_must_be_shared(tmp_path):
    # Each node its own output folder: node 1 holds an older checkpoint only.
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    save(node0, 6, 6.0)
    save(node1, 4, 4.0)
    rank0, rank1 = run_ranks(tmp_path, [node0, node1])
    assert rank0 == {"step": 6, "weight": [6.0]}
    assert rank1 == {
        "error": f"rank 1 finds no checkpoint of step 6 in {node1}, which rank 0 resumes from: "
        "the nodes must share the output folder"
    }


def test_no_checkpoint_starts_from_step_0(tmp_path):
    assert resume(tmp_path / "none", 0, 1, torch.device("cpu")) == (0, None)
