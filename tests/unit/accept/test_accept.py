"""``eyrie accept``: the chain engine end to end, and the SGLang engine's bookkeeping against a stand-in.

The stand-in (``FakeSGLang``) answers SGLang's HTTP routes the way its source says they
answer; a real SGLang needs a GPU, which these machines do not have.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eyrie_testing import eyrie
from pipeline.run.step_contract import read_manifest
from pipeline.steps.accept.accept import Settings, _server_run
from pipeline.steps.sglang import SGLangError, Speculation, gpus_released
from pipeline.steps.train.export import export_draft
from pipeline.steps.train.model import Eagle3Draft, draft_config, vocab_map

EYRIE = [sys.executable, "-m", "pipeline.cli"]


@pytest.fixture(scope="module")
def run_inputs(tmp_path_factory) -> dict[str, Path]:
    """A small random target, shards of random rows, and a draft exported for it (untrained)."""
    root = tmp_path_factory.mktemp("accept")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
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
        "accept", "--engine", "chain", "--draft", str(inputs["draft"]), "--target", str(inputs["target"]),
        "--data", str(inputs["data"]), "--heldout-fraction", "0.3", "--max-length", "64",
        "--num-steps", "3", "--topk", "1", "--num-draft-tokens", "4", "--prompts", "3",
        "--max-new-tokens", "8", "--tp", "0", *extra,
    ]  # fmt: skip


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
    result = subprocess.run([*EYRIE, *_accept_argv(run_inputs, "--topk", "4")], capture_output=True,
                            text=True, env=env, timeout=300)  # fmt: skip
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--topk 1 and --num-draft-tokens 4" in lines[0], lines
    assert not (tmp_path / "accept.json").exists()


class FakeSGLang:
    """A stand-in for SGLang's HTTP server: /generate with meta_info, memory release and resume."""

    def __init__(self, *, memory_saver: bool = True, meta: dict | None = None) -> None:
        self.calls: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None: ...

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                fake.calls.append(self.path)
                memory_routes = ("/release_memory_occupation", "/resume_memory_occupation")
                if self.path == "/generate":
                    answer = {"meta_info": {**(meta or {}), "prompt_tokens": len(body["input_ids"])}}
                elif self.path in memory_routes and memory_saver:
                    answer = {}
                else:
                    self.send_response(404)
                    self.end_headers()
                    self.wfile.write(b'{"detail":"Not Found"}')
                    return
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def test_the_served_target_gives_its_gpus_for_the_step_and_takes_them_back():
    server = FakeSGLang()
    try:
        with gpus_released(server.url):
            assert server.calls == ["/release_memory_occupation"]
        assert server.calls == ["/release_memory_occupation", "/resume_memory_occupation"]
        with gpus_released(None):
            pass
        assert len(server.calls) == 2
    finally:
        server.close()


def test_a_server_that_cannot_release_is_one_line_naming_the_fix():
    server = FakeSGLang(memory_saver=False)
    try:
        with pytest.raises(SGLangError) as info, gpus_released(server.url):
            pytest.fail("the step must not run on GPUs the server still holds")
        message = str(info.value)
        assert "HTTP 404" in message and "--enable-memory-saver" in message and "\n" not in message
    finally:
        server.close()


def test_accept_length_is_sglangs_count_completion_tokens_over_verify_forwards(tmp_path):
    server = FakeSGLang(meta={"completion_tokens": 30, "spec_verify_ct": 12})
    settings = Settings(
        draft=tmp_path, target="t", data=tmp_path, engine="sglang",
        speculation=Speculation(tmp_path, 3, 1, 4), heldout_fraction=0.1, max_length=64, prompts=4,
        max_new_tokens=30, concurrency=2, tp=1, trust_remote_code=False, release_target=None,
        startup_timeout_s=10, request_timeout_s=10,
    )  # fmt: skip
    try:
        run = _server_run(server.url, [[5, 6, 7]] * 4, settings)
    finally:
        server.close()
    assert server.calls.count("/generate") == 5  # one warm-up, then the four prompts
    assert run["output_tokens"] == 120 and run["verify_forwards"] == 48 and run["accept_length"] == 2.5
