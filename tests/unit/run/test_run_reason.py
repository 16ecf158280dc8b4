"""Why a step runs again, said where a user looks: the console as it starts, `status --json`'s
`run_reason`, and `explain`: which input, output or setting changed, or how its last attempt ended."""

from __future__ import annotations

import json
from pathlib import Path

from eyrie_testing import eyrie

PIPELINE = """
steps:
  - name: hog
    command: [sh, -c, "cat ${EYRIE_PIPELINE_DIR}/words.txt > out.txt; test ${MODE:-ok} = ok"]
    memory: 64MiB
    inputs: [words.txt]
    outputs: [out.txt]
  - name: after
    command: [sh, -c, "cat ../hog/out.txt > copy.txt"]
    memory: 64MiB
    needs: [hog]
    outputs: [copy.txt]
"""


def run(tmp_path: Path, **settings: str) -> str:
    """`eyrie run` once more; what it printed."""
    path = tmp_path / "p.yaml"
    result = eyrie("run", str(path), "--run-dir", str(tmp_path / "run"), settings=settings)
    return result.stdout


def reasons(tmp_path: Path) -> list[tuple[str, int, str]]:
    shown = eyrie("status", "--json", "--run-dir", str(tmp_path / "run"), check=True).stdout
    return [(a["step"], a["attempt"], a["run_reason"]) for a in json.loads(shown)]


def test_each_rerun_says_what_changed(tmp_path):
    (tmp_path / "p.yaml").write_text(PIPELINE)
    (tmp_path / "words.txt").write_text("one\n")
    run(tmp_path)
    assert reasons(tmp_path) == [
        ("hog", 1, "it has not run in this run directory"),
        ("after", 1, "it has not run in this run directory"),
    ]

    (tmp_path / "words.txt").write_text("two\n")  # an input
    said = run(tmp_path)
    assert "hog runs again: input words.txt changed" in said, said
    assert "after runs again: the outputs of step hog changed" in said, said

    (tmp_path / "run" / "after" / "copy.txt").write_text("edited\n")  # an output
    said = run(tmp_path)
    assert f"after runs again: an output changed: {tmp_path / 'run' / 'after' / 'copy.txt'} changed" in said

    said = run(tmp_path, MODE="strict")  # a setting: the command it expands to changed, and fails
    assert "hog runs again: its command changed at argument 2: " in said and "test strict = ok'" in said, said
    said = run(tmp_path, MODE="strict")  # the last attempt's verdict
    assert "hog runs again: its last attempt (3) ended failed" in said, said

    assert reasons(tmp_path)[-1] == ("hog", 4, "its last attempt (3) ended failed")
    explained = eyrie("explain", "hog", "--run-dir", str(tmp_path / "run"), check=True).stdout
    assert "It ran because its last attempt (3) ended failed." in explained, explained


NAMING = """
steps:
  - name: prep
    command: [cp, "${CATALOG}", "--target-directory=${EYRIE_RUN_DIR}/prep"]
    memory: 64MiB
"""


def test_a_file_the_command_names_edited_in_place_reruns_its_step(tmp_path):
    """A catalog given by path, edited where it lies: the command is the same, the file is not."""
    (tmp_path / "p.yaml").write_text(NAMING)
    catalog = tmp_path / "elsewhere" / "catalog.yaml"
    catalog.parent.mkdir()
    catalog.write_text("quota: 50\n")
    run(tmp_path, CATALOG=str(catalog))
    catalog.write_text("quota: 50\n")  # written again, the same: nothing to do
    said = run(tmp_path, CATALOG=str(catalog))
    assert "prep runs again" not in said and "up to date" in said, said
    catalog.write_text("quota: 600\n")
    said = run(tmp_path, CATALOG=str(catalog))
    assert f"prep runs again: file {catalog} changed" in said, said
    assert (tmp_path / "run" / "prep" / "catalog.yaml").read_text() == "quota: 600\n"


def test_a_large_named_file_is_known_by_size_and_time_and_run_dir_files_not_at_all(tmp_path, monkeypatch):
    from pipeline.run import fingerprint
    from pipeline.run.spec import load_pipeline

    (tmp_path / "p.yaml").write_text(NAMING)
    step, run_dir = load_pipeline(tmp_path / "p.yaml", {"CATALOG": "weights.gguf"}).steps[0], tmp_path / "run"
    (run_dir / "prep").mkdir(parents=True)
    weights = run_dir / "prep" / "weights.gguf"
    weights.write_bytes(b"x" * 100)
    argv = ["cp", "weights.gguf", "--target-directory=/nowhere"]
    run_own = fingerprint.named_files(run_dir, step, argv, declared=set())
    assert run_own == {}  # the run's own files: the needed steps' manifests cover them
    outside = tmp_path / "weights.gguf"
    outside.write_bytes(b"x" * 100)
    monkeypatch.setattr(fingerprint, "HASHED_FILE_LIMIT", 10)
    named = fingerprint.named_files(run_dir, step, ["cp", f"--model={outside}"], declared=set())
    assert named == {str(outside): f"100 bytes, modified {outside.stat().st_mtime_ns}"}
    assert fingerprint.named_files(run_dir, step, ["cp", str(outside)], declared={outside}) == {}
