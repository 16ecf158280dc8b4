"""Held packed, Kimi-K2.5 trains under a memory limit its dequantized self cannot fit: the proof is
memory, measured in the step's own cgroup, not only equal numbers.

The tests' Kimi-K2.5 (tests/fixtures/kimi_k25) at a size where the routed experts dominate: 3 MoE
layers of 128 experts of 256 x 512, 151M expert weights: 604 MB dense in fp32, 94 MB packed. `eyrie
train` runs as a pipeline step with ``memory: 640MiB``: packed it succeeds (its peak measured here
was ~370 MiB, page cache of the checkpoint included); forced to dequantize (``--dequantize-target``,
~970 MiB when unlimited) it is refused by the planner before the weights load, or OOM-killed.
"""

from __future__ import annotations

import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from eyrie_testing import attempts_json, eyrie

pytest.importorskip("compressed_tensors", reason="the `quantized` extra is not installed")
from tests.fixtures.kimi_k25 import build_tiny_kimi  # noqa: E402

pytestmark = pytest.mark.usefixtures("real_cgroups")
LIMIT = "640MiB"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi-memory")
    target = build_tiny_kimi(
        root / "Kimi-K2.5", hidden_size=256, moe_intermediate_size=512, n_routed_experts=128
    )
    shards = root / "shards"
    shards.mkdir()
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 4096, (32,), generator=generator).tolist() for _ in range(8)]
    pq.write_table(pa.table({"input_ids": rows, "loss_mask": [[0] * 8 + [1] * 24] * 8}), shards / "s.parquet")
    return target, shards


def _train(tmp_path, inputs, *extra: str) -> dict:
    target, shards = inputs
    argv = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "train",
        "--data",
        str(shards),
        "--target",
        str(target),
        "--trust-remote-code",
        "--draft-vocab-size",
        "64",
        "--ttt-steps",
        "2",
        "--batch-size",
        "2",
        "--max-steps",
        "2",
        "--eval-prompts",
        "0",
        "--threads",
        "1",
        "--heldout-fraction",
        "0",
        "--release-target",
        "no",
        "--target-placement",
        "replicated",
        *extra,
    ]
    command = ", ".join(f'"{a}"' for a in argv)
    tmp_path.mkdir()
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(
        f"steps:\n  - name: train\n    command: [{command}]\n    memory: {LIMIT}\n    outputs: [draft]\n"
    )
    eyrie("run", str(pipeline), "--run-dir", str(tmp_path / "run"), timeout=600)
    (attempt,) = [a for a in attempts_json(tmp_path / "run") if a["step"] == "train"]
    log = tmp_path / "run" / ".eyrie" / "logs" / "train" / "attempt-1.stderr.log"
    attempt["stderr"] = log.read_text() if log.is_file() else ""
    return attempt


def test_packed_fits_a_limit_the_dequantized_target_cannot(tmp_path, inputs):
    packed = _train(tmp_path / "packed", inputs)
    assert packed["verdict"] == "succeeded", packed["stderr"][-2000:]
    # The peak counts the checkpoint's page cache, which fills the cgroup up to its limit when the
    # host's cache is warm; what the process itself held is its anonymous peak.
    assert packed["limit_bytes"] == 640 * 2**20 and packed["oom_kills"] == 0
    assert packed["anon_peak_bytes"] is None or packed["anon_peak_bytes"] < packed["limit_bytes"]
    dense = _train(tmp_path / "dense", inputs, "--dequantize-target")
    assert dense["verdict"] in ("failed", "oom_killed"), dense
    if dense["verdict"] == "failed":  # refused up front: the plan counted the dense weights
        assert dense["exit_code"] == 2 and "do not fit" in dense["stderr"], dense["stderr"][-2000:]
