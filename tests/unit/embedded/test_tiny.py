"""The embedded tiny target: tokenizer from the samples, chat template, cached model, the step command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.contract.step import check_manifest
from pipeline.embedded import tiny


def test_tokenizer_is_deterministic_and_learned_from_every_sample_file(tmp_path, monkeypatch):
    monkeypatch.setenv("EYRIE_CACHE_DIR", str(tmp_path / "cache-a"))
    first = (tiny.build_tokenizer() / "tokenizer.json").read_bytes()
    monkeypatch.setenv("EYRIE_CACHE_DIR", str(tmp_path / "cache-b"))
    second = (tiny.build_tokenizer() / "tokenizer.json").read_bytes()
    assert first == second
    vocab = json.loads(first)["model"]["vocab"]
    assert len(vocab) == tiny.VOCAB_SIZE
    tokenizer = AutoTokenizer.from_pretrained(tiny.build_tokenizer())
    for path in tiny._sample_files(tiny.SAMPLES_DIR):
        raw = path.read_text(encoding="utf-8")
        row = json.loads(raw.splitlines()[0]) if path.suffix == ".jsonl" else json.loads(raw)[0]
        text = max(tiny._strings(row), key=len)
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        # Merges learned from the file's own text give 3-6.5 bytes per token here; a tokenizer
        # trained on gsm8k alone gets 1.15-1.4 on the other files.
        assert 2 * len(tokens) < len(text.encode()), path.name


def test_chat_template_renders_every_turn_kind():
    tokenizer = AutoTokenizer.from_pretrained(tiny.build_tokenizer())
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should call the tool.",
            "tool_calls": [
                {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "clock", "arguments": '{"tz": "CET"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "1", "content": "18°C"},
        {"role": "assistant", "content": [{"type": "text", "text": "18°C in Paris."}]},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?")
    assert "<think>\nI should call the tool.\n</think>\n" in text
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_call>\n{"name": "clock", "arguments": {"tz": "CET"}}\n</tool_call>' in text
    assert "<|im_start|>tool\n<tool_response>\n18°C\n</tool_response><|im_end|>" in text
    assert "18°C in Paris.<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    tools = [{"type": "function", "function": {"name": "weather"}}]
    with_tools = tokenizer.apply_chat_template(messages[:2], tools=tools, tokenize=False)
    assert with_tools.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n<tools>\n{")
    for special in ("<|im_start|>", "<|im_end|>", "<think>", "<tool_call>"):
        assert len(tokenizer(special, add_special_tokens=False)["input_ids"]) == 1


def test_target_is_cached_loadable_and_not_degenerate(tmp_path):
    tiny.ensure_tiny_target()  # may build (minutes, once per sample set)
    started = time.monotonic()
    folder = tiny.ensure_tiny_target(tmp_path / "model")
    assert time.monotonic() - started < 10, "a built target must come from the cache"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert model.config.num_hidden_layers == tiny.MODEL_CONFIG["num_hidden_layers"]
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 plus 7?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**prompt, max_new_tokens=48, do_sample=False)[0, prompt["input_ids"].shape[1] :]
    assert len(set(out.tolist())) >= 8, tokenizer.decode(out)
    training = json.loads((folder / "training.json").read_text())
    assert training["final_loss"] < 4.0


def test_step_command_writes_model_and_manifest(tmp_path):
    tiny.ensure_tiny_target()
    env = {**os.environ, "EYRIE_STEP_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "embedded", "target", "--out-dir", "model"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    ok, why = check_manifest(tmp_path, ["model"])
    assert ok, why
    assert (tmp_path / "model" / "model.safetensors").is_file()


def test_missing_samples_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no .jsonl/.json sample files"):
        tiny.build_tokenizer(samples_dir=tmp_path)
