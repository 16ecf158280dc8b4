"""A target that ships its own code (``auto_map``, as Kimi-K2 does) runs only with --trust-remote-code.

The target folder is made here: a small Llama whose config, model and tokenizer classes are
modules in the folder itself, each leaving a mark when Python imports it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.embedded.tiny import build_tokenizer, sample_conversations

EYRIE = [sys.executable, "-m", "pipeline.cli"]
MARK = """
import os, pathlib
pathlib.Path(os.environ["REMOTE_CODE_MARKS"], __name__.rsplit(".", 1)[-1]).touch()
"""
MODULES = {
    "configuration_remote.py": "from transformers import LlamaConfig\n"
    + MARK
    + "class RemoteConfig(LlamaConfig):\n    model_type = 'remote_llama'\n",
    "modeling_remote.py": "from transformers import LlamaForCausalLM\n"
    + "from .configuration_remote import RemoteConfig\n"
    + MARK
    + "class RemoteForCausalLM(LlamaForCausalLM):\n    config_class = RemoteConfig\n",
    "tokenization_remote.py": "from transformers import PreTrainedTokenizerFast\n"
    + MARK
    + "class RemoteTokenizer(PreTrainedTokenizerFast):\n    pass\n",
}


@pytest.fixture(scope="module")
def remote_target(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("remote") / "target"
    build_tokenizer(folder)
    vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]) + 16
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            eos_token_id=1,
            pad_token_id=0,
        )
    ).save_pretrained(folder)
    for name, source in MODULES.items():
        (folder / name).write_text(source)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="remote_llama",
        architectures=["RemoteForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_remote.RemoteConfig",
            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
        },
    )
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config.update(
        tokenizer_class="RemoteTokenizer",
        auto_map={"AutoTokenizer": [None, "tokenization_remote.RemoteTokenizer"]},
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    conversations = folder.parent / "conversations.jsonl"
    with open(conversations, "w") as fh:
        answered = (c for c in sample_conversations() if any(t["role"] == "assistant" for t in c))
        for i, turns in enumerate(answered):
            fh.write(json.dumps({"id": str(i), "conversations": turns}) + "\n")
    return folder


def _run(argv: list[str], cwd: Path, marks: Path, **env: str) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    marks.mkdir(parents=True, exist_ok=True)
    environ = {
        **os.environ,
        "EYRIE_STEP_DIR": str(cwd),
        "OMP_NUM_THREADS": "1",
        "REMOTE_CODE_MARKS": str(marks),
        "HF_HUB_OFFLINE": "1",
    }
    environ.pop("EYRIE_TRUST_REMOTE_CODE", None)
    environ.update(env)
    return subprocess.run(argv, cwd=cwd, env=environ, capture_output=True, text=True, timeout=600)


def _error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def test_tokenize_and_train_refuse_the_targets_code_in_one_line_then_run_it_when_trusted(
    remote_target, tmp_path
):
    conversations = remote_target.parent / "conversations.jsonl"
    tokenize = [
        *EYRIE,
        "tokenize",
        "--tokenizer",
        str(remote_target),
        "--conversations",
        str(conversations),
        "--max-length",
        "256",
        "--workers",
        "1",
    ]
    refused = _run(tokenize, tmp_path / "tokenize-refused", tmp_path / "marks-refused")
    assert refused.returncode == 2, refused.stderr
    lines = _error_lines(refused)
    assert len(lines) == 1 and "--trust-remote-code" in lines[0] and str(remote_target) in lines[0], lines
    assert not list((tmp_path / "marks-refused").iterdir()), "no code of the target ran"

    marks = tmp_path / "marks"
    done = _run([*tokenize, "--trust-remote-code"], tmp_path / "tokenize", marks)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (marks / "tokenization_remote").exists()

    train = [
        *EYRIE,
        "train",
        "--data",
        str(tmp_path / "tokenize" / "shards"),
        "--target",
        str(remote_target),
        "--draft-vocab-size",
        "64",
        "--ttt-steps",
        "2",
        "--batch-size",
        "2",
        "--max-steps",
        "2",
        "--eval-prompts",
        "1",
        "--eval-max-new-tokens",
        "4",
        "--threads",
        "1",
        "--max-length",
        "256",
    ]
    refused = _run(train, tmp_path / "train-refused", tmp_path / "marks-train-refused")
    assert refused.returncode == 2, refused.stderr
    lines = _error_lines(refused)
    assert len(lines) == 1 and "--trust-remote-code" in lines[0], lines
    assert not list((tmp_path / "marks-train-refused").iterdir())

    # the pipeline's way: the permission comes from the environment
    trained = _run(train, tmp_path / "train", marks, EYRIE_TRUST_REMOTE_CODE="1")
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert (marks / "modeling_remote").exists() and (marks / "configuration_remote").exists()
    assert (tmp_path / "train" / "draft" / "config.json").is_file()
