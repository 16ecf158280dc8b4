"""What a user sees when something is wrong: one line, what and where, non-zero exit."""

import json

from eyrie_testing import eyrie


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
    assert len(lines) == 1 and "steps (a).inputs:" in lines[0] and "catalog.yaml does not exist" in lines[0]
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
