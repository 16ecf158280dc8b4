"""``eyrie train``'s settings and launcher: wrong settings are one line each and exit 2, never a traceback."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch.distributed.launcher.api
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from transformers import LlamaConfig

from pipeline.contract.exits import EXIT_BAD_INPUT
from pipeline.contract.step import read_manifest
from pipeline.steps.train import cli, launch
from pipeline.steps.train.cli import check_inputs, load_config
from pipeline.steps.train.config import SettingsError
from pipeline.steps.train.launch import launch_workers, worker_main
from pipeline.steps.train.loop import TrainConfig


@pytest.fixture
def inputs(tmp_path):
    (tmp_path / "shards").mkdir()
    small = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "vocab_size": 128}
    LlamaConfig(num_hidden_layers=4, **small).save_pretrained(tmp_path / "target")  # a config, no weights
    return {"data": tmp_path / "shards", "target": tmp_path / "target"}


def settings_error(config_file, overrides) -> str:
    with pytest.raises(SettingsError) as caught:
        load_config(config_file, overrides)
    return str(caught.value)


def test_an_unknown_key_in_the_file_names_the_file_and_the_key(tmp_path, inputs):
    config = tmp_path / "bad.yaml"
    config.write_text("lr: 1e-3\nlrr: 5\n")
    message = settings_error(config, inputs)
    assert message.startswith(f"{config}: lrr: unknown setting (known: data, target,")
    assert "\n" not in message


def test_a_wrong_value_is_blamed_on_where_it_came_from(tmp_path, inputs):
    config = tmp_path / "train.yaml"
    config.write_text("batch_size: 0\n")
    assert (
        settings_error(config, inputs)
        == f"{config}: batch_size: Input should be greater than or equal to 1, got 0"
    )
    overrides = {**inputs, "layer_ids": ["1", "a", "3"], "lr": None}
    message = settings_error(config, overrides)
    assert message.splitlines() == [
        "--layer-ids: layer_ids.1: Input should be a valid integer, unable to parse string as an integer, "
        "got 'a'",
        f"{config}: batch_size: Input should be greater than or equal to 1, got 0",
    ]


def test_missing_broken_or_odd_config_files(tmp_path, inputs):
    missing = tmp_path / "missing.yaml"
    assert settings_error(missing, inputs) == f"{missing}: cannot read it: No such file or directory"
    broken = tmp_path / "broken.yaml"
    broken.write_text("lr: 1e-3\nlayer_ids: [1,\n")
    assert settings_error(broken, inputs).startswith(f"{broken}:3: not valid YAML: ")
    listing = tmp_path / "list.yaml"
    listing.write_text("- lr\n")
    assert settings_error(listing, inputs) == f"{listing}: expected 'setting: value' lines, got a list"
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing set\n")
    assert load_config(empty, inputs) == TrainConfig(**inputs)


def test_a_target_folder_without_a_model_config(tmp_path, inputs):
    cfg = TrainConfig(data=inputs["data"], target=tmp_path)
    with pytest.raises(
        SettingsError, match=r"--target .* is not a Hugging Face model folder \(no config.json\)"
    ):
        check_inputs(cfg)


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_torchrun_worker_says_bad_input_once_per_node_and_exits_2(
    tmp_path, inputs, monkeypatch, capsys, local_rank
):
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert worker_main(tmp_path / "nope.json") == EXIT_BAD_INPUT
    # The data is fine and the target has a config but no weights: found only when a worker loads it.
    rows = {"input_ids": [list(range(2, 34))] * 4, "loss_mask": [[0] * 8 + [1] * 24] * 4}
    pq.write_table(pa.table(rows), inputs["data"] / "shard-00000.parquet")
    resolved = tmp_path / "train_config.json"
    resolved.write_text(TrainConfig(**inputs, out_dir=tmp_path).model_dump_json())
    assert worker_main(resolved) == EXIT_BAD_INPUT
    lines = capsys.readouterr().err.splitlines()
    if local_rank == "0":
        assert lines[0] == f"error: {tmp_path / 'nope.json'}: cannot read it: No such file or directory"
        assert lines[1].startswith(f"error: --target {inputs['target']}: cannot load the model: ")
        assert len(lines) == 2
    else:
        assert lines == []


@pytest.mark.parametrize(("exitcode", "rc", "resume"), [(2, 2, False), (1, 1, True), (-9, 1, True)])
def test_launcher_offers_a_resume_only_when_a_worker_did_not_refuse_its_input(
    tmp_path, monkeypatch, capsys, exitcode, rc, resume
):
    def failing_launch(config, entrypoint):
        def launch(*args):
            failure = ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file="<N/A>")
            raise ChildFailedError("pipeline.steps.train", {0: failure})

        return launch

    monkeypatch.setattr(torch.distributed.launcher.api, "elastic_launch", failing_launch)
    cfg = TrainConfig(data=tmp_path, target=tmp_path, out_dir=tmp_path, nproc=2)
    assert launch_workers(cfg, tmp_path / "train_config.json") == (rc, False)
    err = capsys.readouterr().err
    assert ("a rerun resumes from the last checkpoint" in err) == resume
    if exitcode == -9:
        assert "worker rank 0 died of signal 9" in err


@pytest.mark.parametrize("ranks_here", [[0, 1], [2, 3]])
def test_only_the_node_of_global_rank_0_writes_the_manifest(
    tmp_path, inputs, monkeypatch, capsys, ranks_here
):
    step = tmp_path / "step"
    monkeypatch.setenv("EYRIE_STEP_DIR", str(step))

    def launch_here(config, entrypoint):
        assert config.min_nodes == config.max_nodes == 2 and config.nproc_per_node == 2
        if 0 in ranks_here:  # what global rank 0's worker leaves behind
            (step / "draft").mkdir()
            placement = {"placement": "replicated", "devices": []}
            report = {
                "optimizer_steps": 4,
                "precision": "fp32",
                "attention": "sdpa",
                "simulated": {},
                "speculative_decoding": {},
                "target_placement": placement,
            }
            (step / "eval.json").write_text(json.dumps(report))
        return lambda *args: dict.fromkeys(ranks_here)

    monkeypatch.setattr(torch.distributed.launcher.api, "elastic_launch", launch_here)
    assert cli.train_command(None, **inputs, nproc=2, nnodes=2) == 0
    if 0 in ranks_here:
        stats = read_manifest(step).stats
        assert stats["optimizer_steps"] == 4 and stats["target_placement"]["placement"] == "replicated"
    else:
        assert read_manifest(step) is None
        assert "the node of global rank 0 writes the draft and the manifest" in capsys.readouterr().err


def test_resolved_settings_round_trip(tmp_path, inputs):
    resolved = tmp_path / "train_config.json"
    cfg = TrainConfig(**inputs, out_dir=tmp_path, layer_ids=[1, 2, 3])
    resolved.write_text(cfg.model_dump_json())
    assert launch.read_resolved(resolved) == cfg
    resolved.write_text(json.dumps({**json.loads(cfg.model_dump_json()), "nproc": 0}))
    with pytest.raises(
        SettingsError, match=rf"^{resolved}: nproc: Input should be greater than or equal to 1"
    ):
        launch.read_resolved(resolved)


def test_an_unknown_placement_is_one_line_naming_the_choices(inputs):
    assert settings_error(None, {**inputs, "target_placement": "spread"}) == (
        "--target-placement: Input should be 'auto', 'replicated', 'sharded' or 'offline', got 'spread'"
    )
    with pytest.raises(SettingsError, match=r"^--target-placement offline runs on one node \(--nnodes 1\)"):
        check_inputs(TrainConfig(**inputs, target_placement="offline", nnodes=2))


def test_an_internal_error_is_a_failure_with_its_traceback_never_a_bad_input_line(
    tmp_path, inputs, monkeypatch
):
    """Only the step's own error types are bad input (exit 2, no resume offered): a ValueError from a
    bug propagates, and the launcher offers a resume."""
    resolved = tmp_path / "train_config.json"
    resolved.write_text(TrainConfig(**inputs, out_dir=tmp_path).model_dump_json())

    def buggy(cfg):
        raise ValueError("a bug")

    monkeypatch.setattr(launch, "worker", buggy)
    with pytest.raises(ValueError, match="a bug"):
        worker_main(resolved)


def test_a_target_server_that_does_not_answer_fails_the_step_and_is_no_settings_problem(
    tmp_path, inputs, monkeypatch, capsys
):
    from fakes.fake_sglang import FakeSGLang

    from pipeline.steps.serving import sglang

    monkeypatch.setattr(sglang.time, "sleep", lambda seconds: None)
    monkeypatch.setenv("EYRIE_STEP_DIR", str(tmp_path / "step"))
    server = FakeSGLang(failures={"/server_info": [503] * 20})
    try:
        code = cli.train_command(None, **inputs, release_target=server.url)
    finally:
        server.close()
    assert code == cli.EXIT_FAILED
    assert server.calls.count("/server_info") == 1 + sglang.Retry().max_retries
    assert "a rerun tries again" in capsys.readouterr().err
