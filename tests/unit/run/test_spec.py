from pathlib import Path

import pytest

from pipeline.run.spec import PipelineError, load_pipeline


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    return path


GOOD = """
steps:
  - name: prep
    command: [eyrie, prep]
    memory: 2GiB
    timeout: 30m
    outputs: [prompts.jsonl]
  - name: train
    command: [eyrie, train]
    memory: 512MiB
    needs: [prep]
    retries: 2
"""


def test_valid_pipeline(tmp_path):
    spec = load_pipeline(write(tmp_path, GOOD))
    assert [s.name for s in spec.order()] == ["prep", "train"]
    assert spec.step("prep").memory == 2 * 2**30
    assert spec.step("prep").timeout == 1800
    assert spec.dependents("prep") == ["train"]
    assert spec.upstream("train") == ["prep"] and spec.upstream("prep") == []


@pytest.mark.parametrize(
    "mutation,expected",
    [
        (("memory: 2GiB", "memory: 2GB2"), r"steps\[0\] \(prep\)\.memory: invalid size '2GB2'"),
        (("timeout: 30m", "timeout: soon"), r"steps\[0\] \(prep\)\.timeout: invalid duration"),
        (("timeout: 30m", "timeout: 0s"), r"steps\[0\] \(prep\)\.timeout: duration must be positive"),
        (("retries: 2", "retrys: 2"), r"steps\[1\] \(train\)\.retrys: unknown key"),
        (
            ("needs: [prep]", "needs: [prepp]"),
            r"\(train\)\.needs: unknown step 'prepp'; did you mean 'prep'\?",
        ),
        (("outputs: [prompts.jsonl]", "outputs: [../escape]"), r"must be a relative path"),
        (("name: train", "name: prep"), r"repeated: prep"),
    ],
)
def test_errors_name_the_file_and_the_key(tmp_path, mutation, expected):
    path = write(tmp_path, GOOD.replace(*mutation))
    with pytest.raises(PipelineError, match=expected) as info:
        load_pipeline(path)
    message = str(info.value)
    assert message.startswith(str(path)) and "\n" not in message


def test_cycle_is_an_error(tmp_path):
    text = GOOD.replace("    outputs: [prompts.jsonl]", "    outputs: [prompts.jsonl]\n    needs: [train]")
    with pytest.raises(PipelineError, match="cycle"):
        load_pipeline(write(tmp_path, text))


def test_bad_yaml_points_at_the_line(tmp_path):
    with pytest.raises(PipelineError, match=r"pipeline.yaml:\d+:\d+: invalid YAML"):
        load_pipeline(write(tmp_path, "steps:\n  - name: [unclosed\n"))


def test_missing_file(tmp_path):
    with pytest.raises(PipelineError, match="no such pipeline file"):
        load_pipeline(tmp_path / "nope.yaml")


def test_a_folder_is_not_a_pipeline_file(tmp_path):
    with pytest.raises(PipelineError, match=f"^{tmp_path}: cannot read pipeline file: .*directory"):
        load_pipeline(tmp_path)


def test_a_file_not_in_utf8_is_refused_in_one_line(tmp_path):
    path = tmp_path / "pipeline.yaml"
    path.write_bytes(b"steps:\n  - name: caf\xe9\n")
    expected = r"pipeline.yaml: cannot read pipeline file: not UTF-8 \(byte 0xe9"
    with pytest.raises(PipelineError, match=expected) as info:
        load_pipeline(path)
    assert "\n" not in str(info.value)


SETTINGS = """
steps:
  - name: train
    command: [eyrie, train, --target, "${TARGET:-Qwen/Qwen3-8B}", --out-dir, "${EYRIE_STEP_DIR}/x", "${OWN}"]
    memory: "${TRAIN_MEMORY:-2GiB}"
    gpus: "${GPUS:-0}"
    docker: {image: "eyrie-pipeline:${TAG:-latest}"}
    env: {OWN: "own-${TAG:-latest}"}
"""


def test_settings_come_from_the_environment_with_defaults(tmp_path):
    path = write(tmp_path, SETTINGS)
    spec = load_pipeline(path, environ={})
    step = spec.step("train")
    assert step.command[3] == "Qwen/Qwen3-8B" and step.memory == 2 * 2**30 and step.gpus == 0
    assert spec.executor_options("docker", "train").image == "eyrie-pipeline:latest"
    assert step.env == {"OWN": "own-latest"}
    # the runner's variables and the step's own env are left for the runner
    assert step.command[5:] == ["${EYRIE_STEP_DIR}/x", "${OWN}"]
    environ = {"TARGET": "/models/kimi", "TRAIN_MEMORY": "400GiB", "GPUS": "8", "TAG": "v1"}
    spec = load_pipeline(path, environ=environ)
    step = spec.step("train")
    assert step.command[3] == "/models/kimi" and step.memory == 400 * 2**30 and step.gpus == 8
    assert spec.executor_options("docker", "train").image == "eyrie-pipeline:v1"
    assert step.env == {"OWN": "own-v1"}
    # an empty setting takes the default, as in compose files
    assert load_pipeline(path, environ={"GPUS": ""}).step("train").gpus == 0


def test_a_setting_without_default_must_be_set(tmp_path):
    path = write(tmp_path, SETTINGS.replace("${GPUS:-0}", "${GPUS}"))
    with pytest.raises(PipelineError) as info:
        load_pipeline(path, environ={})
    assert str(info.value) == (
        f"{path}:6: steps[0] (train).gpus: unknown variable ${{GPUS}}: not set in the environment; "
        "set it, or give a default: ${GPUS:-VALUE}"
    )
    with pytest.raises(PipelineError, match=r"steps\[0\] \(train\)\.gpus: Input should be a valid integer"):
        load_pipeline(path, environ={"GPUS": "eight"})


@pytest.mark.parametrize("name", ["ledger.sqlite", "ledger.sqlite-wal", "report.html"])
def test_a_step_named_like_eyries_own_files_is_refused_in_one_line(tmp_path, name):
    """Its folder would sit where the ledger or the report is written (``eyrie report`` once lost a
    step named report.html, outputs and all)."""
    path = write(tmp_path, GOOD.replace("name: train", f"name: {name}"))
    with pytest.raises(PipelineError, match=rf"{name}: a name eyrie keeps for its own files") as info:
        load_pipeline(path)
    assert str(info.value).startswith(str(path)) and "\n" not in str(info.value)


def test_a_step_named_like_eyries_state_folder_is_refused(tmp_path):
    with pytest.raises(PipelineError, match=r"steps\[1\] \(.eyrie\)\.name"):
        load_pipeline(write(tmp_path, GOOD.replace("name: train", "name: .eyrie")))
