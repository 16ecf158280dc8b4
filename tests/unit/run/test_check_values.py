"""`eyrie run --check` refuses what `eyrie run` would: each step's values through its own settings, in
the environment the run gives it; the limits, inputs and GPUs `run` checks before it starts; train's
placement plan where the target's config.json is on disk. One line each, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from eyrie_testing import REAL_JOB, REAL_JOB_CPU_SETTINGS, eyrie
from pipeline.memory import format_size, memory_budget


@pytest.fixture(scope="module")
def target_config_only(tmp_path_factory) -> Path:
    """A tiny Llama's config.json alone: all --check reads of a target (no weights, no tokenizer)."""
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("target")
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    config.save_pretrained(folder)
    return folder


def check_real_job(tmp_path: Path, target: Path, **settings: str):
    """`eyrie run --check` of the real pipeline file on its CPU settings, ``settings`` on top."""
    given = {**REAL_JOB_CPU_SETTINGS, "EYRIE_TARGET_MODEL": str(target), **settings}
    return eyrie("run", "--check", str(REAL_JOB), "--run-dir", str(tmp_path / "run"), settings=given)


def refused_lines(result) -> list[str]:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return [line for line in result.stderr.splitlines() if line.strip()]


def test_the_real_job_on_cpu_settings_passes_the_check(tmp_path, target_config_only):
    result = check_real_job(tmp_path, target_config_only)
    assert result.returncode == 0, result.stderr
    assert "ok, 5 step(s), 1 service(s)" in result.stdout
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "setting,value,said",
    [
        ("EYRIE_TARGET_PLACEMENT", "shraded", "steps[3] (train).command: eyrie train: --target-placement: "),
        ("EYRIE_TRAIN_PROCESSES", "eight", "steps[3] (train).command: eyrie train: --nproc: "),
        ("EYRIE_TARGET_ENGINE", "vllm", "services[0] (target).command: eyrie serve: --engine: "),
        ("EYRIE_ACCEPT_BENCH", "mtbench,gsm8k", "steps[4] (accept).command: eyrie accept: --bench: "),
    ],
)
def test_a_wrong_setting_is_refused_by_its_steps_own_settings(
    tmp_path, target_config_only, setting, value, said
):  # noqa: E501
    lines = refused_lines(check_real_job(tmp_path, target_config_only, **{setting: value}))
    assert len(lines) == 1, lines
    assert said in lines[0] and repr(value.split(",")[-1]) in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


def test_trains_placement_plan_is_made_from_the_targets_config(tmp_path, target_config_only):
    """Rows far beyond what this host holds: the planner refuses, at --check, on the meta device."""
    result = check_real_job(tmp_path, target_config_only, EYRIE_BATCH_SIZE="4096", EYRIE_MAX_LENGTH="65536")
    lines = refused_lines(result)
    assert len(lines) == 1, lines
    assert "steps[3] (train).command: eyrie train: the draft needs " in lines[0], lines
    assert "lower --batch-size or --max-length" in lines[0], lines
    assert not (tmp_path / "run").exists()


def one_step(tmp_path: Path, step: str) -> list[str]:
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(f"steps:\n  - name: a\n    command: [true]\n{step}")
    return refused_lines(eyrie("run", "--check", str(pipeline), "--run-dir", str(tmp_path / "run")))


def test_a_limit_over_what_the_host_has_is_refused(tmp_path):
    (line,) = one_step(tmp_path, "    memory: 1TiB\n")
    assert (
        "p.yaml:4: steps[0] (a).memory: 1.00 TiB exceeds the " in line and "this host really has" in line
    ), line
    assert not (tmp_path / "run").exists()


def test_a_step_asking_the_whole_hosts_memory_is_refused(tmp_path):
    total = memory_budget().mem_total
    (line,) = one_step(tmp_path, f"    memory: {total // 2**20}MiB\n")
    assert f"p.yaml:4: steps[0] (a).memory: {format_size(total // 2**20 * 2**20)} exceeds the " in line, line


def test_a_step_asking_more_gpus_than_the_host_has_is_refused(tmp_path):
    (line,) = one_step(tmp_path, "    memory: 64MiB\n    gpus: 4096\n")
    assert "p.yaml:5: steps[0] (a).gpus: 4096, more than the " in line and "GPU(s) this host has" in line, (
        line
    )


def test_a_missing_input_is_refused(tmp_path):
    (line,) = one_step(tmp_path, "    memory: 64MiB\n    inputs: [no-such.txt]\n")
    assert f"p.yaml:5: steps[0] (a).inputs: {tmp_path / 'no-such.txt'} does not exist" in line, line
