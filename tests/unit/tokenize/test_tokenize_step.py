"""`eyrie tokenize` as a step: shards with a manifest, per-source counts, truncation, clear refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.contract.exits import EXIT_BAD_INPUT
from pipeline.contract.step import check_manifest, read_manifest
from pipeline.steps.tokenize.run import run_tokenize


def shards(out: Path) -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in sorted((out / "shards").glob("shard-*.parquet")))


@pytest.fixture(scope="module")
def answered(prepped, tmp_path_factory) -> Path:
    """Prep's prompts with an answer appended, each row made by the generate step's own code."""
    from pipeline.steps.generate.conversation import Plan, output_row

    path = tmp_path_factory.mktemp("generate") / "conversations.jsonl"
    with open(path, "w", encoding="utf-8") as out:
        for line in (prepped / "prompts.jsonl").read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            plan = Plan(row["messages"], "last_turn")
            plan.next_history()
            plan.feed(
                {"role": "assistant", "content": "Here is a short answer.", "reasoning_content": "Think."}
            )
            out.write(json.dumps(output_row(row, plan, ["stop"]), ensure_ascii=False) + "\n")
    return path


def test_tokenize_prepped_outputs(prepped, answered, tiny_tokenizer, tmp_path):
    out = tmp_path / "tok"
    inputs = [answered, prepped / "native.jsonl"]
    assert (
        run_tokenize(tiny_tokenizer, inputs, [prepped / "native_tokenized.parquet"], out, shard_rows=100) == 0
    )
    ok, why = check_manifest(out, ["shards"])
    assert ok, why
    manifest = read_manifest(out)
    table = shards(out)
    prompts = len((prepped / "prompts.jsonl").read_text().splitlines())
    native = len((prepped / "native.jsonl").read_text().splitlines())
    assert table.num_rows == manifest.records() == prompts + native + 24
    assert (
        len(list((out / "shards").glob("shard-*.parquet")))
        == manifest.stats["shards"]
        == -(-table.num_rows // 100)
    )
    stats = manifest.stats
    assert stats["mask_method"] == "generation_markers" and stats["chat_template"] == "tokenizer"
    assert set(stats["sources"]) == set(table.column("source").to_pylist())
    assert len(stats["sources"]) == 10
    assert stats["totals"]["tokens"] == sum(len(x) for x in table.column("input_ids").to_pylist())
    assert stats["totals"]["assistant_tokens"] == sum(sum(x) for x in table.column("loss_mask").to_pylist())
    # ChatML opens the answer after "assistant\n": only answers that open with <think> go in pieces
    assert 0 < stats["totals"]["tokenized_in_pieces"] < stats["totals"]["rows"]
    for ids, mask in zip(
        table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist(), strict=True
    ):
        assert len(ids) == len(mask) and 0 < sum(mask) < len(mask)
    # every training row maps back to its conversation (and prompt) and to its row in the dataset
    origin = {}
    for name in ("prompts.jsonl", "native.jsonl"):
        for line in (prepped / name).read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            origin[record["id"]] = (record["source"], record["source_id"])
    for row in pq.read_table(prepped / "native_tokenized.parquet").to_pylist():
        origin[row["id"]] = (row["source"], row["source_id"])
    rows = table.select(["id", "source", "source_id"]).to_pylist()
    assert len({r["id"] for r in rows}) == len(rows) == len(origin)
    assert all(origin[r["id"]] == (r["source"], r["source_id"]) for r in rows)
    generated = [json.loads(line) for line in answered.read_text(encoding="utf-8").splitlines()]
    assert all(g["source_id"] == origin[g["id"]][1] for g in generated)  # generation keeps it too


def test_truncation_is_counted(prepped, tiny_tokenizer, tmp_path):
    out = tmp_path / "tok"
    assert run_tokenize(tiny_tokenizer, [prepped / "native.jsonl"], [], out, max_length=600) == 0
    stats = read_manifest(out).stats["totals"]
    lengths = [len(x) for x in shards(out).column("input_ids").to_pylist()]
    assert max(lengths) == 600 and stats["truncated"] >= sum(n == 600 for n in lengths) > 0


def test_truncation_counts_the_assistant_tokens_it_drops(prepped, tiny_tokenizer, tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert run_tokenize(tiny_tokenizer, [prepped / "native.jsonl"], [], whole, max_length=1 << 20) == 0
    assert run_tokenize(tiny_tokenizer, [prepped / "native.jsonl"], [], cut, max_length=600) == 0
    full, kept = (read_manifest(out).stats["totals"] for out in (whole, cut))
    assert full["truncated"] == full["assistant_tokens_truncated"] == 0
    assert kept["truncated"] > 0 and kept["assistant_tokens_truncated"] > 0
    # a row cut to no assistant token at all is rejected: its tokens count as dropped too
    assert kept["assistant_tokens"] + kept["assistant_tokens_truncated"] == full["assistant_tokens"]


@pytest.mark.parametrize("workers", [1, 2])
def test_invalid_utf8_is_one_line_naming_the_file_and_line(workers, tiny_tokenizer, tmp_path, capsys):
    good = json.dumps(
        {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "caf\u00e9"}]}
    )
    bad = tmp_path / "conversations.jsonl"
    bad.write_bytes(good.encode() + b"\n" + good.replace("\\u00e9", "\xe9").encode("latin-1") + b"\n")
    out = tmp_path / "out"
    assert run_tokenize(tiny_tokenizer, [bad], [], out, workers=workers) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert f"error: {bad}:2 is not UTF-8" in " ".join(err.split()) and "Traceback" not in err
    assert not (out / "shards").exists() and not (out / "manifest.json").exists()


def test_a_failed_rerun_leaves_no_manifest_over_the_old_shards(prepped, tiny_tokenizer, tmp_path):
    out = tmp_path / "tok"
    assert run_tokenize(tiny_tokenizer, [prepped / "native.jsonl"], [], out) == 0
    bad = tmp_path / "conversations.jsonl"
    bad.write_text("not json\n")
    assert run_tokenize(tiny_tokenizer, [bad], [], out) == EXIT_BAD_INPUT
    assert not check_manifest(out, ["shards"])[0] and (out / "shards").is_dir()


def test_pretokenized_ids_outside_the_vocabulary_are_rejected(tiny_tokenizer, tmp_path):
    rows = tmp_path / "native_tokenized.parquet"
    pq.write_table(
        pa.table(
            {
                "input_ids": [[1, 2, 3], [1, 10**6, 3]],
                "loss_mask": [[0, 1, 1], [0, 1, 1]],
                "source": ["a", "a"],
            }
        ),
        rows,
    )
    out = tmp_path / "tok"
    assert run_tokenize(tiny_tokenizer, [], [rows], out) == 0
    assert read_manifest(out).stats["sources"]["a"]["rejected"] == {"id_out_of_vocab": 1}
    (kept,) = shards(out).to_pylist()
    # a file prep did not write has no ids: the row gets prep's kind of id, and its index in the file
    assert kept["source_id"] == "#0" and len(kept["id"]) == 32


def test_a_pretokenized_file_without_ids_gets_the_ids_prep_gives(prepped, tiny_tokenizer, tmp_path):
    """prep and tokenize make a tokenized row's id in one place, so the same row has the same id."""
    written = pq.read_table(prepped / "native_tokenized.parquet")
    bare = tmp_path / "bare.parquet"
    pq.write_table(written.drop_columns(["id", "source_id"]), bare)
    out = tmp_path / "tok"
    assert run_tokenize(tiny_tokenizer, [], [bare], out) == 0
    assert written.num_rows > 0
    assert sorted(shards(out).column("id").to_pylist()) == sorted(written.column("id").to_pylist())


def test_kimi_template_on_a_tokenizer_without_its_tokens_is_refused(prepped, tiny_tokenizer, tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "tokenize",
            "--tokenizer",
            str(tiny_tokenizer),
            "--conversations",
            str(prepped / "native.jsonl"),
            "--chat-template",
            "kimi-k2",
            "--out-dir",
            str(tmp_path / "tok"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    err = " ".join(result.stderr.split())
    assert "chat template 'kimi-k2' writes <|im_assistant|>" in err and "does not have as tokens" in err
    assert not (tmp_path / "tok" / "shards").exists()


def test_missing_inputs_and_bad_records_are_one_line_errors(tiny_tokenizer, tmp_path, capsys):
    assert run_tokenize(tiny_tokenizer, [tmp_path / "nope.jsonl"], [], tmp_path / "a") == 2
    assert "nope.jsonl do not exist" in capsys.readouterr().err
    bad = tmp_path / "conversations.jsonl"
    bad.write_text('{"id": "x", "messages": []}\n')
    assert run_tokenize(tiny_tokenizer, [bad], [], tmp_path / "b") == EXIT_BAD_INPUT
    assert f"{bad}:1 is not a conversation record" in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "b" / "shards").exists() and not (tmp_path / "b" / "manifest.json").exists()


def test_worker_processes_give_the_same_shards_as_one_process(prepped, answered, tiny_tokenizer, tmp_path):
    inputs = [answered, prepped / "native.jsonl"]
    assert run_tokenize(tiny_tokenizer, inputs, [], tmp_path / "one", workers=1) == 0
    assert run_tokenize(tiny_tokenizer, inputs, [], tmp_path / "two", workers=2) == 0
    assert read_manifest(tmp_path / "one").stats["workers"]["workers"] == 1
    assert read_manifest(tmp_path / "two").stats["workers"]["workers"] == 2
    assert shards(tmp_path / "two").equals(shards(tmp_path / "one"))  # same rows, same order


def test_a_bad_record_fails_the_step_from_a_worker_too(tiny_tokenizer, tmp_path, capsys):
    lines = [
        json.dumps(
            {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
        )
    ] * 600
    lines.insert(555, "not json")
    bad = tmp_path / "conversations.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    assert run_tokenize(tiny_tokenizer, [bad], [], tmp_path / "out", workers=2) == EXIT_BAD_INPUT
    assert f"{bad}:556 is not a conversation record" in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "out" / "shards").exists()


def test_a_killed_worker_fails_the_step_without_shards(
    prepped, tiny_tokenizer, tmp_path, capsys, monkeypatch
):
    import os
    import signal

    from pipeline.steps.tokenize.tokenizer import Tokenizer

    # Workers are forked, so they inherit the patched method: the first batch kills its worker.
    monkeypatch.setattr(Tokenizer, "encode_lines", lambda *_: os.kill(os.getpid(), signal.SIGKILL))
    assert run_tokenize(tiny_tokenizer, [prepped / "native.jsonl"], [], tmp_path / "out", workers=2) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "a tokenize worker process died (killed by a signal" in err and "--workers 1" in err
    assert not (tmp_path / "out" / "shards").exists() and not (tmp_path / "out" / "manifest.json").exists()


def test_a_bad_worker_memory_is_a_one_line_error_naming_the_option(tiny_tokenizer, tmp_path, capsys):
    conversations = tmp_path / "conversations.jsonl"
    conversations.write_text("")
    assert run_tokenize(tiny_tokenizer, [conversations], [], tmp_path / "out", worker_memory="lots") == 2
    assert "--worker-memory: invalid size 'lots'" in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "out" / "shards").exists()


def test_a_tokenizer_folder_that_is_missing_or_empty_is_named_as_such(prepped, tmp_path, capsys):
    conversations = [prepped / "native.jsonl"]
    (tmp_path / "empty").mkdir()
    cases = {
        str(tmp_path / "nope"): f"--tokenizer {tmp_path / 'nope'}: no such folder",
        "./nope": "--tokenizer ./nope: no such folder",
        str(tmp_path / "empty"): f"--tokenizer {tmp_path / 'empty'}: no tokenizer files in it (expected one "
        "of tokenizer.json, tokenizer_config.json, tokenizer.model, tiktoken.model, vocab.json)",
    }
    for number, (given, said) in enumerate(cases.items()):
        assert run_tokenize(given, conversations, [], tmp_path / f"out{number}") == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"error: {said}" in err, err
        assert "Repo id" not in err
        assert not (tmp_path / f"out{number}" / "shards").exists()
