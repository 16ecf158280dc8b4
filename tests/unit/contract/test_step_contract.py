import json
import os
import re

import pytest

from pipeline.contract import atomic
from pipeline.contract.atomic import atomic_path, atomic_write_text
from pipeline.contract.step import (
    check_manifest,
    manifest_digest,
    read_manifest,
    service_urls,
    service_urls_path,
    write_manifest,
)


def test_manifest_round_trip_and_tamper_detection(tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"id": 1}\n{"id": 2}\n')
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "a.parquet").write_bytes(b"PAR1")
    manifest = write_manifest(
        tmp_path, ["prompts.jsonl", "shards"], records={"shards": 7}, stats={"accepted": 2}, fingerprint="f00"
    )
    assert manifest.outputs["prompts.jsonl"]["."].records == 2
    assert manifest.records() == 9
    assert read_manifest(tmp_path).fingerprint == "f00"
    assert check_manifest(tmp_path, ["prompts.jsonl", "shards"]) == (True, "manifest matches the files")
    digest = manifest_digest(tmp_path)
    (tmp_path / "shards" / "a.parquet").write_bytes(b"PAR2")
    complete, why = check_manifest(tmp_path)
    assert not complete and "changed" in why
    assert manifest_digest(tmp_path) == digest  # the digest is of the manifest, which did not change


def test_check_manifest_requires_declared_outputs(tmp_path):
    (tmp_path / "a.txt").write_text("a")
    write_manifest(tmp_path, ["a.txt"])
    complete, why = check_manifest(tmp_path, ["a.txt", "b.txt"])
    assert not complete and "b.txt" in why


def test_missing_output_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="declared output 'nope.jsonl'"):
        write_manifest(tmp_path, ["nope.jsonl"])
    assert read_manifest(tmp_path) is None


def test_atomic_path_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out.jsonl"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []
    with atomic_path(target) as tmp:
        tmp.write_text(json.dumps({"ok": True}))
    assert json.loads(target.read_text()) == {"ok": True}
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


def test_a_file_written_over_another_is_swapped_in_so_its_name_never_goes_missing(tmp_path, monkeypatch):
    """Processes that write the same file at once (e.g. the ranks that convert training rows) may
    be opening it meanwhile: they find the old file or the new one, never none."""
    target = tmp_path / "rows.arrow"
    target.write_text("old")
    there = []

    def replace(source, destination):
        there.append(target.read_text())
        os.rename(source, destination)

    monkeypatch.setattr(atomic.os, "replace", replace)
    with atomic_path(target) as tmp:
        tmp.write_text("new")
    assert there == ["old"]
    assert target.read_text() == "new"


def test_a_folder_is_on_disk_whole_before_its_name_says_complete(tmp_path, monkeypatch):
    """After a power loss a renamed folder must not hold a torn file: every file in it and the folder
    itself are fsynced before the rename, and the parent (which holds the new name) after it."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    monkeypatch.setattr(atomic.os, "replace", replace)
    final = tmp_path / "step-00000100"
    with atomic_path(final) as tmp:
        tmp.mkdir()
        (tmp / "nested").mkdir()
        (tmp / "state.pt").write_bytes(b"weights")
        (tmp / "nested" / "meta.json").write_text("{}")
    renamed = events.index(("rename", str(final)))
    before = {path for kind, path in events[:renamed] if kind == "fsync"}
    assert before == {str(tmp / "state.pt"), str(tmp / "nested" / "meta.json"), str(tmp / "nested"), str(tmp)}
    assert events[renamed + 1 :] == [("fsync", str(tmp_path))]
    assert (final / "state.pt").read_bytes() == b"weights"


def test_a_services_urls_are_where_the_runner_says_its_replicas_answer_now(tmp_path):
    env = {"EYRIE_RUN_DIR": str(tmp_path), "EYRIE_SERVICE_WEB_URLS": "http://a:1,http://b:2"}
    assert service_urls("web", env) == ["http://a:1", "http://b:2"]  # as given: nothing moved yet
    atomic_write_text(service_urls_path(tmp_path, "web"), "http://a:1\nhttp://c:2\n")
    assert service_urls("web", env) == ["http://a:1", "http://c:2"]  # the second started again on c
    # A file that does not list every replica is not this run's word on them.
    atomic_write_text(service_urls_path(tmp_path, "web"), "http://a:1\n")
    assert service_urls("web", env) == ["http://a:1", "http://b:2"]
    assert service_urls("web", {"EYRIE_RUN_DIR": str(tmp_path)}) == []  # a step that does not use it


def test_a_file_is_never_written_over_a_folder(tmp_path):
    """A folder holds what it holds: writing a file at its name leaves it, and everything in it."""
    precious = tmp_path / "precious"
    (precious / "deep").mkdir(parents=True)
    (precious / "deep" / "keep.txt").write_text("mine")
    with pytest.raises(IsADirectoryError, match="precious is a folder"):
        atomic_write_text(precious, "<html>")
    assert (precious / "deep" / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious"]  # no temporary left


def test_a_folder_output_written_again_replaces_the_earlier_one(tmp_path):
    shards = tmp_path / "shards"
    for content in ("first", "second"):
        with atomic_path(shards) as tmp:
            tmp.mkdir()
            (tmp / "0.txt").write_text(content)
    assert [p.name for p in shards.iterdir()] == ["0.txt"] and (shards / "0.txt").read_text() == "second"


def _folder_output(root):
    (root / "dir" / "sub").mkdir(parents=True)
    (root / "dir" / "a.txt").write_text("a")
    (root / "dir" / ".state").write_text("hidden")
    (root / "dir" / "sub" / "b.txt").write_text("b")
    write_manifest(root, ["dir"])


@pytest.mark.parametrize(
    "change,said",
    [
        (lambda d: (d / "c.txt").write_text("extra"), r"dir/c.txt not in manifest.json: added"),
        (lambda d: (d / "sub" / ".stray").write_text("x"), r"dir/sub/.stray not in manifest.json: added"),
        (lambda d: (d / "a.txt").unlink(), r"dir/a.txt is listed in manifest.json but missing"),
        (lambda d: (d / ".state").unlink(), r"dir/.state is listed in manifest.json but missing"),
        (lambda d: (d / ".state").write_text("HIDDEN"), r"dir/.state changed since"),
    ],
)
def test_a_folder_outputs_manifest_covers_its_whole_content(tmp_path, change, said):
    """An added, removed or changed file, hidden or not, anywhere in a folder output, is a change:
    a stray shard in tokenize/shards would otherwise be read by train without a word."""
    _folder_output(tmp_path)
    assert check_manifest(tmp_path, ["dir"]) == (True, "manifest matches the files")
    assert ".state" in read_manifest(tmp_path).outputs["dir"]
    change(tmp_path / "dir")
    complete, why = check_manifest(tmp_path, ["dir"])
    assert not complete
    assert re.search(said, why), why
