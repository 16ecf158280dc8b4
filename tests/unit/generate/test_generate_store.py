"""The resume state: a torn last line is cut off, complete lines are the rows done."""

from __future__ import annotations

import json

import pytest

from pipeline.steps.generate.json_text import utf8_json
from pipeline.steps.generate.store import JsonlAppender, StoreError, read_ids, repair_tail


def test_torn_last_line_is_cut_and_complete_lines_kept(tmp_path):
    path = tmp_path / "rows.jsonl"
    appender = JsonlAppender(path)
    appender.write_lines([utf8_json({"id": "a", "x": 1}) + b"\n", utf8_json({"id": "b", "x": 2}) + b"\n"])
    appender.close()
    whole = path.read_bytes()
    with open(path, "ab") as fh:
        fh.write(b'{"id": "c", "x": ')  # what a kill in the middle of a write leaves
    assert repair_tail(path) == len(b'{"id": "c", "x": ')
    assert path.read_bytes() == whole
    assert read_ids(path) == ["a", "b"]
    assert repair_tail(path) == 0


def test_a_file_that_is_one_torn_line_becomes_empty(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"id": "a"' * 200_000)  # longer than one read chunk, no newline at all
    repair_tail(path)
    assert path.read_bytes() == b""
    assert read_ids(path) == []


def test_damage_before_the_last_line_is_an_error_not_silently_dropped(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"id": "a"}) + "\nnot json\n" + json.dumps({"id": "b"}) + "\n")
    with pytest.raises(StoreError, match="rows.jsonl:2"):
        read_ids(path)
