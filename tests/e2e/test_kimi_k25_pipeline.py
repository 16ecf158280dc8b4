"""The real pipeline file (pipeline/jobs/eagle3.yaml) on the tests' Kimi-K2.5, as a user runs
it: prep (the bundled samples) → generate → tokenize (Kimi's own tiktoken tokenizer and template,
converted and checked) → train (sharded, then offline: the experts held packed) → accept (the
chain engine, the draft loaded strictly).

Nothing on a CPU serves this target for generate as it ships: ``transformers serve`` loads a
checkpoint through transformers' own route, which would not find the packed experts it reads
(their quantization config sits in ``text_config``) and would answer from random ones, and SGLang
needs a GPU. So the answers come from the fake OpenAI-compatible server (tests/fakes), with
reasoning: generate still runs for real, over HTTP, and the conversations it writes are fed on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from eyrie_testing import REPO, attempts_json
from tests.e2e.generate.generate_helpers import FakeServer

pytest.importorskip("compressed_tensors", reason="the `quantized` extra is not installed")
from tests.fixtures.kimi_k25 import build_tiny_kimi  # noqa: E402

pytestmark = pytest.mark.usefixtures("real_cgroups")
PIPELINE = REPO / "pipeline" / "jobs" / "eagle3.yaml"
STEPS = ["prep", "generate", "tokenize", "train", "accept"]


def _settings(target, url, cache, placement: str) -> dict[str, str]:
    return {
        "EYRIE_TARGET_MODEL": str(target),
        "EYRIE_TRUST_REMOTE_CODE": "1",
        "EYRIE_TARGET_URL": url,
        "EYRIE_RELEASE_TARGET": "no",
        "EYRIE_GPUS": "0",
        "EYRIE_TRAIN_PROCESSES": "1",
        "EYRIE_ACCEPT_ENGINE": "chain",
        "EYRIE_PREP_DATA": "offline",
        "EYRIE_QUOTA": "6",
        "EYRIE_MAX_TOKENS": "32",
        "EYRIE_CONCURRENCY": "8",
        "EYRIE_MAX_LENGTH": "512",
        "EYRIE_MAX_STEPS": "2",
        "EYRIE_BATCH_SIZE": "2",
        "EYRIE_DRAFT_VOCAB": "256",
        "EYRIE_TTT_STEPS": "2",
        "EYRIE_HELDOUT_FRACTION": "0.2",
        "EYRIE_ACCEPT_PROMPTS": "2",
        "EYRIE_ACCEPT_MAX_NEW_TOKENS": "6",
        "EYRIE_TARGET_PLACEMENT": placement,
        "EYRIE_PREP_MEMORY": "1536MiB",
        "EYRIE_GENERATE_MEMORY": "512MiB",
        "EYRIE_TOKENIZE_MEMORY": "1GiB",
        "EYRIE_TRAIN_MEMORY": "3GiB",
        "EYRIE_ACCEPT_MEMORY": "2GiB",
        "EYRIE_CACHE_DIR": str(cache),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }


def _run(run_dir, settings) -> None:
    env = {**os.environ, **settings}
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "run", str(PIPELINE), "--run-dir", str(run_dir)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def test_the_real_pipeline_file_trains_a_draft_for_kimi_k25(tmp_path):
    target = build_tiny_kimi(tmp_path / "Kimi-K2.5")
    server = FakeServer("--reasoning", "--model", str(target))
    try:
        run_dir = tmp_path / "run"
        _run(run_dir, _settings(target, server.url, tmp_path / "cache", "sharded"))
        first = {a["step"]: a for a in attempts_json(run_dir)}
        assert [first[s]["verdict"] for s in STEPS] == ["succeeded"] * 5
        tokenized = json.loads((run_dir / "tokenize" / "manifest.json").read_text())["stats"]
        assert tokenized["mask_method"].startswith("message_probes") and tokenized["tokenizer"]
        plan = json.loads((run_dir / "train" / "eval.json").read_text())["target_placement"]
        assert plan["placement"] == "sharded" and plan["target_holding"] == "packed"
        assert json.loads((run_dir / "accept" / "accept.json").read_text())
        # The same file, offline: train and accept run again, the steps before them are kept.
        _run(run_dir, _settings(target, server.url, tmp_path / "cache", "offline"))
        runs = {a["run_id"] for a in first.values()}
        rerun = [a for a in attempts_json(run_dir) if a["run_id"] not in runs]
        assert sorted(a["step"] for a in rerun if a["verdict"] == "succeeded") == ["accept", "train"]
        plan = json.loads((run_dir / "train" / "eval.json").read_text())["target_placement"]
        assert plan["placement"] == "offline" and plan["features_pass"]["target_holding"] == "packed"
    finally:
        server.kill()
