"""What a user sees when something is wrong: one line, what and where, non-zero exit."""

import json
import os
import time

import pytest

from eyrie_testing import eyrie
from pipeline.run.spec import PipelineError, load_pipeline


def test_bad_pipeline_is_one_line_naming_file_and_key(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("steps:\n  - name: a\n    command: [true]\n    memory: 64MiB\n    colour: blue\n")
    result = eyrie("run", str(path), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert str(path) in lines[0] and "steps[0] (a).colour: unknown key" in lines[0]
    assert not (tmp_path / "run").exists()  # nothing half-made


def test_unknown_variable_in_a_command_is_refused_before_anything_runs(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text('steps:\n  - name: a\n    command: [echo, "${EYRIE_NOPE}"]\n    memory: 64MiB\n')
    result = eyrie("run", str(path), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert "unknown variable ${EYRIE_NOPE}" in result.stderr


def test_a_missing_input_is_refused_before_anything_runs(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        "steps:\n  - name: a\n    command: [true]\n    memory: 64MiB\n    inputs: [catalog.yaml]\n"
    )
    result = eyrie("run", str(path), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert (
        len(lines) == 1
        and f"{path}:5: steps[0] (a).inputs:" in lines[0]
        and "catalog.yaml does not exist" in lines[0]
    )
    assert not (tmp_path / "run" / "a").exists()


def test_unknown_executor(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("steps:\n  - name: a\n    command: [true]\n    memory: 64MiB\n")
    result = eyrie("run", str(path), "--executor", "k8s", "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and "unknown executor" in result.stderr


def test_status_without_a_ledger_says_how_to_get_one(tmp_path):
    result = eyrie("status", "--run-dir", str(tmp_path))
    assert result.returncode == 2
    assert "no ledger at" in result.stderr and "eyrie run" in result.stderr


def test_memory_json_reports_a_budget_no_larger_than_memavailable():
    result = eyrie("memory", "--json", check=True)
    budget = json.loads(result.stdout)
    assert 0 < budget["available"] <= budget["mem_available"] <= budget["mem_total"]
    assert budget["cgroup_version"] in (1, 2)
    assert budget["cgroups"], "the process's own cgroup chain is listed"
    assert "--executor slurm this budget does not apply" in budget["note"]
    assert "this budget does not apply" in eyrie("memory", check=True).stdout


def test_a_ledger_that_cannot_be_read_is_one_line_naming_it(tmp_path):
    ledger = tmp_path / "ledger.sqlite"
    ledger.write_text("not a database\n" * 100)
    for command in ("status", "report"):
        result = eyrie(command, "--run-dir", str(tmp_path))
        assert result.returncode == 2, result.stderr
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and str(ledger) in lines[0], result.stderr
    result = eyrie("explain", "prep", "--run-dir", str(tmp_path))
    assert result.returncode == 2 and str(ledger) in result.stderr and "Traceback" not in result.stderr


def test_a_misspelled_key_is_named_with_the_key_it_is_nearest(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        "nme: x\ndocker: {imag: x}\nsteps:\n  - name: a\n    comand: [true]\n    memory: 64MiB\n"
        "    timout: 5m\n    slurm: {partitoin: gpu}\n    docker: {colour: blue}\n"
    )
    result = eyrie("run", str(path), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    lines = sorted(line.removeprefix(f"error: {path}:") for line in result.stderr.splitlines())
    assert lines == [
        "1: nme: unknown key; did you mean 'name'?",
        "2: docker.imag: unknown key; did you mean 'image'?",
        "5: steps[0] (a).comand: unknown key; did you mean 'command'?",  # not also "command: missing"
        "7: steps[0] (a).timout: unknown key; did you mean 'timeout'?",
        "8: steps[0] (a).slurm.partitoin: unknown key; did you mean 'partition'?",
        "9: steps[0] (a).docker.colour: unknown key (known: image, shm_size)",
    ], result.stderr


def test_a_step_that_needs_itself_is_said_so(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("steps:\n  - name: a\n    command: [true]\n    memory: 64MiB\n    needs: [a]\n")
    result = eyrie("run", str(path), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {path}:5: steps[0] (a).needs: step 'a' needs itself", (
        result.stderr
    )


def test_one_step_is_one_step(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("steps:\n  - name: a\n    command: [true]\n    memory: 64MiB\n")
    result = eyrie("run", str(path), "--run-dir", str(tmp_path / "run"), check=True)
    assert ": 1 step, budget" in result.stdout, result.stdout


def test_a_refused_run_leaves_nothing(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("steps:\n  - name: a\n    command: [true]\n    memory: 65536TiB\n")
    run_dir = tmp_path / "runs" / "first"
    result = eyrie("run", str(path), "--run-dir", str(run_dir))
    assert result.returncode == 2 and "exceeds the" in result.stderr, result.stderr
    assert not (tmp_path / "runs").exists()  # no run folder, no ledger
    run_dir.mkdir(parents=True)
    (run_dir / "notes.txt").write_text("mine\n")
    assert eyrie("run", str(path), "--run-dir", str(run_dir)).returncode == 2
    assert [p.name for p in run_dir.iterdir()] == ["notes.txt"]  # a folder that was there keeps only its own
    status = eyrie("status", "--run-dir", str(run_dir))
    assert status.returncode == 2 and "no ledger at" in status.stderr


def test_a_command_not_found_is_refused_before_the_run_starts(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        "steps:\n  - name: first\n    command: [true]\n    memory: 64MiB\n"
        "  - name: b\n    command: [eyrie-no-such-program, x]\n    memory: 64MiB\n    needs: [first]\n"
    )
    result = eyrie("run", str(path), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert (
        len(lines) == 1 and f"{path}:6: steps[1] (b).command: 'eyrie-no-such-program': not found" in lines[0]
    ), lines
    assert not (tmp_path / "run").exists()  # `first` never ran
    path.write_text("steps:\n  - name: a\n    command: [/no/such/tool]\n    memory: 64MiB\n")
    result = eyrie("run", str(path), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and "'/no/such/tool': no such file" in result.stderr, result.stderr


def test_check_names_each_steps_problem_and_writes_nothing(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        "steps:\n  - name: train\n    command: [eyrie, train, prompts.jsonl]\n    memory: 64MiB\n"
        "  - name: b\n    command: [eyrie-no-such-program]\n    memory: 64MiB\n"
    )
    result = eyrie("run", "--check", str(path), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"error: {path}:3: steps[0] (train).command: eyrie train: Missing option '--data'.",
        f"error: {path}:6: steps[1] (b).command: 'eyrie-no-such-program': not found on the step's PATH; "
        "install it, or give its full path",
    ]
    assert not (tmp_path / "run").exists()


def test_run_on_a_damaged_ledger_is_one_line_naming_it_and_leaves_it_as_it_was(tmp_path):
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text("steps:\n  - name: a\n    command: [true]\n    memory: 64MiB\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ledger = run_dir / "ledger.sqlite"
    ledger.write_text("not a database\n" * 100)
    result = eyrie("run", str(pipeline), "--run-dir", str(run_dir))
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"cannot read the ledger {ledger}: file is not a database" in lines[0]
    assert "move it aside" in lines[0]
    assert ledger.read_text() == "not a database\n" * 100
    assert sorted(p.name for p in run_dir.iterdir()) == ["ledger.sqlite"]  # nothing half-made


def test_a_ledger_restarted_from_nothing_says_so(tmp_path):
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text("steps:\n  - name: a\n    command: [true]\n    memory: 64MiB\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "ledger.sqlite").write_bytes(b"")
    result = eyrie("run", str(pipeline), "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    said = [line for line in result.stdout.splitlines() if "was empty (0 bytes)" in line]
    assert len(said) == 1 and str(run_dir / "ledger.sqlite") in said[0], result.stdout
    assert "a new ledger starts there" in said[0]
    again = eyrie("run", str(pipeline), "--run-dir", str(run_dir), check=True)  # a real ledger now
    assert "0 bytes" not in again.stdout and "new ledger" not in again.stdout
    (run_dir / "ledger.sqlite").unlink()  # lost, beside the logs of the attempts it held
    result = eyrie("run", str(pipeline), "--run-dir", str(run_dir), check=True)
    assert f"no ledger in {run_dir}, though it holds earlier attempts' logs" in result.stdout


def test_a_command_argument_too_long_to_exec_is_refused_at_check_and_at_start(tmp_path):
    """Linux takes at most 32 pages (128 KiB) in one argument; past that exec says only "Argument
    list too long", after the step's cgroup was made."""
    path = tmp_path / "p.yaml"
    path.write_text(f"steps:\n  - name: a\n    command: [echo, ok, {'x' * 2**20}]\n    memory: 64MiB\n")
    limit = f"{32 * os.sysconf('SC_PAGE_SIZE'):,}"
    for check in (["--check"], []):
        result = eyrie("run", str(path), "--run-dir", str(tmp_path / "run"), *check)
        assert result.returncode == 2, result.stdout + result.stderr
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, result.stderr
        assert f"{path}:3: steps[0] (a).command[2]: 1,048,577 bytes, over the {limit} bytes" in lines[0]
        assert "MAX_ARG_STRLEN" in lines[0]
        assert not (tmp_path / "run").exists()  # nothing made, no cgroup left


def test_a_yaml_alias_bomb_is_refused_within_a_second(tmp_path):
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    path = tmp_path / "p.yaml"
    path.write_text("\n".join(levels) + "\nsteps:\n  - name: a\n    command: [true]\n    memory: 64MiB\n")
    started = time.monotonic()
    with pytest.raises(PipelineError) as info:
        load_pipeline(path)
    assert time.monotonic() - started < 1.0
    assert str(info.value).startswith(f"{path}: more than 100,000 values once its YAML aliases")
    result = eyrie("run", str(path), "--check", "--run-dir", str(tmp_path / "run"), timeout=30)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr


HOG = "steps:\n  - name: hog\n    command: [true]\n    memory: 64MiB\n"


def check_lines(tmp_path, text: str) -> list[str]:
    """What `eyrie run --check` says of a pipeline file holding ``text``: it exits 2, writes nothing."""
    path = tmp_path / "p.yaml"
    path.write_text(text)
    result = eyrie("run", "--check", str(path), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert not (tmp_path / "run").exists()
    return [line.removeprefix("error: ") for line in result.stderr.splitlines()]


def test_a_size_without_its_unit_is_refused_not_read_as_bytes(tmp_path):
    lines = check_lines(tmp_path, HOG.replace("64MiB", "256"))
    assert lines == [
        f"{tmp_path / 'p.yaml'}:4: steps[0] (hog).memory: 256: a size needs a unit: write e.g. "
        "256MiB or 256GiB"
    ]


def test_a_misspelled_need_is_answered_with_the_step_it_is_nearest(tmp_path):
    after = "  - name: after-hog\n    command: [true]\n    memory: 64MiB\n    needs: [hgo]\n"
    lines = check_lines(tmp_path, HOG + after)
    assert lines == [
        f"{tmp_path / 'p.yaml'}:8: steps[1] (after-hog).needs: unknown step 'hgo'; did you mean "
        "'hog'? (steps: hog, after-hog)"
    ]


def test_bad_indentation_is_said_at_its_line_and_column_with_the_line_shown(tmp_path):
    lines = check_lines(tmp_path, HOG.replace("    memory", "  memory"))
    assert lines[0].startswith(f"{tmp_path / 'p.yaml'}:4:3: invalid YAML: this line, indented to column 3, ")
    assert "does not continue the block begun at line 2, column 3" in lines[0]
    assert "<block end>" not in lines[0] and "'?'" not in lines[0]
    assert lines[1:] == ["      memory: 64MiB", "      ^"]  # the line, and a caret under column 3


def test_explain_of_an_attempt_that_does_not_exist_lists_the_steps_attempts(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(HOG)
    eyrie("run", str(path), "--run-dir", str(tmp_path / "run"), check=True)
    result = eyrie("explain", "hog", "--attempt", "9", "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert (
        result.stderr.strip() == f"error: no attempt 9 of step 'hog' in {tmp_path / 'run'}; its attempts: 1"
    )


def test_the_check_says_ok_on_one_line_in_a_pipe(tmp_path):
    path = tmp_path / ("a-long-folder-name-" * 4) / "p.yaml"  # past 80 columns
    path.parent.mkdir()
    path.write_text(HOG)
    result = eyrie("run", "--check", str(path), "--run-dir", str(tmp_path / "run"), check=True)
    assert result.stdout.splitlines() == [f"{path}: ok, 1 step(s)"]
