"""benchmarks/draft_quality.py runs the real pipeline file with settings of its own: they pass
`eyrie run --check`, so the benchmark cannot drift from the file it measures."""

from __future__ import annotations

import argparse

from benchmarks import draft_quality
from eyrie_testing import REAL_JOB, eyrie


def test_the_benchmarks_settings_and_catalog_pass_the_real_jobs_check(tmp_path):
    from transformers import LlamaConfig

    target = tmp_path / "target"
    LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ).save_pretrained(target)
    args = argparse.Namespace(
        max_tokens=128,
        native=50,
        batch_tokens=2048,
        threads=2,
        lr=3e-3,
        draft_vocab=512,
        ttt_steps=3,
        eval_prompts=2,
        eval_tokens=16,
    )
    run_dir = tmp_path / "run"
    settings = draft_quality.settings(args, run_dir, str(target), rows=10, steps=5, chain_steps=7)
    assert draft_quality.REAL_JOB == REAL_JOB
    assert settings["EYRIE_ACCEPT_BENCH"] == "mtbench,humaneval"
    sources = draft_quality.yaml.safe_load(open(settings["EYRIE_CATALOG"]))["sources"]
    assert [(s["name"], s.get("prompt"), s.get("native"), s["quota"]) for s in sources] == [
        ("sharegpt_v3", "first_turn", None, 10),
        ("sharegpt_v3_answers", None, True, 50),
    ]
    result = eyrie("run", "--check", str(REAL_JOB), "--run-dir", str(run_dir), settings=settings)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not run_dir.exists()
