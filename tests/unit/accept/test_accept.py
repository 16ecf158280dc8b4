"""``eyrie accept``: the chain engine end to end, and the SGLang engine against a test fake of its
server (``tests/fakes/fake_sglang.py``); a real SGLang needs a GPU, which these machines do not have."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from fakes.fake_sglang import FakeSGLang
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from eyrie_testing import eyrie
from pipeline.cli import app
from pipeline.contract.exits import EXIT_BAD_INPUT
from pipeline.contract.step import read_manifest
from pipeline.steps.accept import measure
from pipeline.steps.accept.config import AcceptRun
from pipeline.steps.accept.measure import _server_run
from pipeline.steps.eagle3 import decoding
from pipeline.steps.eagle3.export import export_draft
from pipeline.steps.eagle3.model import Eagle3Draft, draft_config, vocab_map
from pipeline.steps.generate.client import Retry
from pipeline.steps.serving.sglang import Parsers

EYRIE = [sys.executable, "-m", "pipeline.cli"]


@pytest.fixture(scope="module")
def run_inputs(tmp_path_factory) -> dict[str, Path]:
    """A small random target, shards of random rows, and a draft exported for it (untrained)."""
    root = tmp_path_factory.mktemp("accept")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=1,
        pad_token_id=0,
    )
    target = LlamaForCausalLM(config)
    target.save_pretrained(root / "target")
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randint(2, 128, (24,), generator=generator).tolist() for _ in range(40)]
    (root / "shards").mkdir()
    pq.write_table(
        pa.table({"input_ids": rows, "loss_mask": [[0] * 8 + [1] * 16] * 40, "source": ["random"] * 40}),
        root / "shards" / "shard-00000.parquet",
    )
    d2t, t2d = vocab_map(torch.arange(128).flip(0), 64)
    draft = Eagle3Draft(draft_config(config, 64, [1, 2, 3]))
    with torch.no_grad():
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
    export_draft(draft, root / "draft", [1, 2, 3], dtype=torch.float32)
    return {"root": root, "target": root / "target", "data": root / "shards", "draft": root / "draft"}


def _accept_argv(inputs: dict[str, Path], *extra: str) -> list[str]:
    return [
        "accept",
        "--engine",
        "chain",
        "--draft",
        str(inputs["draft"]),
        "--target",
        str(inputs["target"]),
        "--data",
        str(inputs["data"]),
        "--heldout-fraction",
        "0.3",
        "--max-length",
        "64",
        "--num-steps",
        "3",
        "--topk",
        "1",
        "--num-draft-tokens",
        "4",
        "--prompts",
        "3",
        "--max-new-tokens",
        "8",
        "--tp",
        "0",
        *extra,
    ]


@pytest.mark.usefixtures("real_cgroups")
def test_chain_acceptance_as_a_pipeline_step_lands_in_the_manifest_and_the_report(run_inputs, tmp_path):
    pipeline = tmp_path / "accept.yaml"
    argv = json.dumps(["eyrie", *_accept_argv(run_inputs), "--num-steps", "${K:-3}"])
    pipeline.write_text(
        f"steps:\n  - name: accept\n    command: {argv}\n    memory: 2GiB\n    outputs: [accept.json]\n"
        "    env: {OMP_NUM_THREADS: '1'}\n"
    )
    run_dir = tmp_path / "run"
    result = eyrie("run", str(pipeline), "--run-dir", str(run_dir), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    report = json.loads((run_dir / "accept" / "accept.json").read_text())
    assert report["engine"] == "chain" and report["prompts"] == 3 and report["num_steps"] == 3
    assert report["accept_length"] >= 1.0
    assert report["output_tokens_per_s"] > 0 and report["baseline_output_tokens_per_s"] > 0
    assert report["baseline"]["accept_length"] is None  # no speculation, nothing accepted
    # the same tokens with and without the draft (checked by the step), counted alike
    assert report["speculative"]["output_tokens"] == report["baseline"]["output_tokens"]
    assert read_manifest(run_dir / "accept").stats["accept_length"] == report["accept_length"]
    page = Path(eyrie("report", "--run-dir", str(run_dir), check=True).stdout.strip()).read_text()
    assert "accept length" in page and str(report["accept_length"]) in page
    assert f"{report['baseline_output_tokens_per_s']}" in page


def test_chain_needs_one_chain_of_num_steps_plus_one(run_inputs, tmp_path):
    env = {**os.environ, "EYRIE_STEP_DIR": str(tmp_path)}
    result = subprocess.run(
        [*EYRIE, *_accept_argv(run_inputs, "--topk", "4")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--topk 1 and --num-draft-tokens 4" in lines[0], lines
    assert not (tmp_path / "accept.json").exists()


def _sglang_settings(inputs: dict[str, Path], **changes) -> AcceptRun:
    settings = AcceptRun(
        draft=inputs["draft"],
        target=str(inputs["target"]),
        data=inputs["data"],
        engine="sglang",
        num_steps=3,
        topk=1,
        num_draft_tokens=4,
        heldout_fraction=0.3,
        max_length=64,
        prompts=3,
        max_new_tokens=30,
        concurrency=2,
        tp=1,
        startup_timeout_s=10,
        request_timeout_s=10,
        retry=Retry(base_s=0.0, cap_s=0.0),
    )
    return settings.model_copy(update=changes)


class Served(list):
    """The speculation each server the step started was started with, and the parsers of each."""

    parsers: list[Parsers]


@pytest.fixture
def served(monkeypatch):
    """SGLang servers the step starts, replaced by test fakes."""
    started = Served()
    started.parsers = []
    fake = FakeSGLang(meta={"completion_tokens": 30, "spec_verify_ct": 12})

    @contextlib.contextmanager
    def sglang_server(model, log_path, *, tp, trust_remote_code, parsers, speculation, startup_timeout_s):
        started.append(speculation)
        started.parsers.append(parsers)
        yield fake.url

    monkeypatch.setattr(measure, "sglang_server", sglang_server)
    yield started
    fake.close()


def test_the_servers_split_answers_as_the_target_is_served(run_inputs, served, tmp_path, monkeypatch):
    """``--reasoning-parser``/``--tool-call-parser`` (the pipeline's EYRIE_REASONING_PARSER and
    EYRIE_TOOL_CALL_PARSER) reach both servers accept starts."""
    monkeypatch.setenv("EYRIE_STEP_DIR", str(tmp_path))
    argv = [arg if arg != "chain" else "sglang" for arg in _accept_argv(run_inputs)]
    argv[argv.index("--tp") + 1] = "1"
    named = ["--reasoning-parser", "kimi_k2", "--tool-call-parser", "kimi_k2"]
    result = CliRunner().invoke(app, [*argv, *named])
    assert result.exit_code == 0, result.output
    assert served.parsers == [Parsers("kimi_k2", "kimi_k2")] * 2
    # none named (the pipeline file's default, an empty name): none passed
    assert CliRunner().invoke(app, [*argv, "--reasoning-parser", "", "--tool-call-parser", ""]).exit_code == 0
    assert served.parsers[2:] == [Parsers()] * 2


def test_accept_length_is_sglangs_count_completion_tokens_over_verify_forwards(tmp_path, run_inputs):
    server = FakeSGLang(
        meta={"completion_tokens": 30, "spec_verify_ct": 12}, failures={"/generate": [503, 502]}
    )
    try:
        run = _server_run(server.url, [[5, 6, 7]] * 4, _sglang_settings(run_inputs)).run(3)
    finally:
        server.close()
    # one warm-up, then the four prompts; two answers of "not now" sent again
    assert server.calls.count("/generate") == 5 + 2
    assert run["output_tokens"] == 120 and run["verify_forwards"] == 48 and run["accept_length"] == 2.5


def test_chain_accept_length_is_pooled_over_requests_against_the_targets_own_generate(
    run_inputs, tmp_path, monkeypatch, capsys
):
    """Completion tokens over verifying forwards of all the requests together (SGLang's and vLLM's
    count, not a mean of per-request means), the acceptance rate at each draft position, and a
    baseline that is the target's own greedy ``generate``, which the speculative tokens equal."""
    yielded: list[list[int]] = []
    generated: list[list[int]] = []
    real_speculative, real_generate = decoding.ChainDecoder.generate, decoding.greedy_generate

    def speculative(*args):
        tokens, per_forward = real_speculative(*args)
        yielded.append(per_forward)
        return tokens, per_forward

    def greedy(*args):
        generated.append(real_generate(*args))
        return generated[-1]

    monkeypatch.setattr(decoding.ChainDecoder, "generate", speculative)
    monkeypatch.setattr(decoding, "greedy_generate", greedy)
    settings = _sglang_settings(run_inputs, engine="chain", max_new_tokens=12)
    assert measure.run_accept(settings, tmp_path) == 0
    report = json.loads((tmp_path / "accept.json").read_text())
    measured, timed = yielded[1:], generated[1:]  # the first of each is the warm-up
    assert len(measured) == len(timed) == report["prompts"] == 3
    forwards = sum(len(per_forward) for per_forward in measured)
    assert report["speculative"]["verify_forwards"] == forwards
    # Each request's first token comes from its prompt's forward: a completion token, not a verifying forward.
    assert report["accept_length"] == round((sum(map(sum, measured)) + len(measured)) / forwards, 3)
    assert report["accept_length"] == round(report["speculative"]["output_tokens"] / forwards, 3)
    assert report["accept_length_is"].startswith("pooled over requests")
    assert "pooled over requests" in capsys.readouterr().err
    assert report["baseline"]["output_tokens"] == sum(map(len, timed))
    rates = report["acceptance_rate_per_position"]
    assert len(rates) == 3 and all(0 <= r <= 1 for r in rates) and rates == sorted(rates, reverse=True)


def test_accept_records_the_speculation_sglang_runs(run_inputs, served, tmp_path, capsys):
    """With topk 1 SGLang v0.5.12 verifies num_steps + 1 tokens whatever num_draft_tokens says."""
    settings = _sglang_settings(run_inputs, num_steps=5)
    assert measure.run_accept(settings, tmp_path) == 0
    assert served[0].num_draft_tokens == 6 and served[1] is None  # with the draft, then without
    report = json.loads((tmp_path / "accept.json").read_text())
    assert (report["num_steps"], report["topk"], report["num_draft_tokens"]) == (5, 1, 6)
    assert "6 tokens verified per target forward, not --num-draft-tokens 4" in capsys.readouterr().err
    branching = _sglang_settings(run_inputs, num_steps=5, topk=4, num_draft_tokens=16)
    assert measure.run_accept(branching, tmp_path) == 0
    assert json.loads((tmp_path / "accept.json").read_text())["num_draft_tokens"] == 16


def test_the_draft_is_checked_strictly_before_anything_is_measured(run_inputs, served, tmp_path, capsys):
    """SGLang would skip a tensor it does not know and leave a missing one random: a wrong folder is
    one line and exit 2 on both engines, before any server starts."""
    broken = tmp_path / "draft"
    shutil.copytree(run_inputs["draft"], broken)
    weights = load_file(broken / "model.safetensors")
    weights["fc.bias"] = weights.pop("fc.weight")[:, 0].contiguous()
    save_file(weights, broken / "model.safetensors")
    for engine in ("sglang", "chain"):
        settings = _sglang_settings(run_inputs, draft=broken, engine=engine)
        assert measure.run_accept(settings, tmp_path / engine) == EXIT_BAD_INPUT
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and "missing fc.weight; unexpected fc.bias" in lines[0], lines
    assert served == []
    other = tmp_path / "other"  # a draft made for a target of another width
    shutil.copytree(run_inputs["draft"], other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "target_hidden_size": 64}))
    assert measure.run_accept(_sglang_settings(run_inputs, draft=other), tmp_path) == 2
    assert "a draft for another target" in capsys.readouterr().err


def test_a_server_that_stops_answering_fails_the_step_and_never_reads_as_bad_input(
    run_inputs, monkeypatch, tmp_path
):
    fake = FakeSGLang(failures={"/generate": [503] * 20})

    @contextlib.contextmanager
    def sglang_server(*args, **kwargs):
        yield fake.url

    monkeypatch.setattr(measure, "sglang_server", sglang_server)
    try:
        assert measure.run_accept(_sglang_settings(run_inputs), tmp_path) == measure.EXIT_FAILED
    finally:
        fake.close()
    assert fake.calls.count("/generate") == 1 + Retry().max_retries  # the warm-up, through its retries
    assert not (tmp_path / "accept.json").exists()
