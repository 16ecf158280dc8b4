"""`eyrie prep` as a step: the default catalog on its samples, counts, dedup, quotas, seeds, failures."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.contract.step import check_manifest, read_manifest
from pipeline.steps.prep.catalog import load_catalog
from pipeline.steps.prep.run import OUTPUTS, run_prep

SAMPLES = Path(__file__).resolve().parents[3] / "pipeline" / "embedded" / "samples"


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def write_catalog(tmp_path: Path, sources: list[dict], **extra) -> Path:
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump({"sources": sources, **extra}), encoding="utf-8")
    return path


def test_default_catalog_offline_gives_records_from_every_source(prepped):
    ok, why = check_manifest(prepped, OUTPUTS)
    assert ok, why
    manifest = read_manifest(prepped)
    stats = manifest.stats["sources"]
    assert len(stats) == 10 and all(s["accepted"] > 0 and s["error"] is None for s in stats.values())
    for name, s in stats.items():  # every row read is accounted for exactly once
        assert s["read"] == s["accepted"] + s["duplicates"] + sum(s["rejected"].values()), name
    # the awkward rows of the samples are rejected under their reasons, not silently
    assert stats["swe_smith_trajectories"]["rejected"] == {"bad_json": 1}
    assert stats["hermes_agent_kimi"]["rejected"] == {"bad_tool_call": 1, "no_assistant_turn": 1}
    assert stats["sharegpt_vicuna"]["rejected"] == {"empty_prompt": 2}

    prompts = lines(prepped / "prompts.jsonl")
    native = lines(prepped / "native.jsonl")
    by_kind = {"prompts": prompts, "native": native}
    for name, s in stats.items():
        if s["kind"] in by_kind:
            assert sum(r["source"] == name for r in by_kind[s["kind"]]) == s["accepted"], name
    assert len({r["id"] for r in prompts + native}) == len(prompts) + len(native)
    assert all(r["messages"][-1]["role"] in ("user", "tool") for r in prompts)
    assert all(r["conversations"][-1]["role"] == "assistant" for r in native)
    assert manifest.outputs["prompts.jsonl"]["."].records == len(prompts)
    tokenized = pq.read_table(prepped / "native_tokenized.parquet")
    assert tokenized.num_rows == stats["native_tokenized"]["accepted"] == 24
    assert tokenized.column_names == ["input_ids", "loss_mask", "source", "id", "source_id"]
    # reasoning and tool calls come out structured
    hermes = [r for r in native if r["source"] == "hermes_agent_kimi"]
    assert all("<think>" not in m["content"] for r in hermes for m in r["conversations"])
    assert any(m.get("tool_calls") for r in hermes for m in r["conversations"])
    assert any(r["tools"] for r in hermes)


def test_same_seed_same_bytes_other_seed_other_order(prepped, tmp_path):
    again, other = tmp_path / "again", tmp_path / "other"
    assert run_prep(None, again, offline=True) == 0
    assert run_prep(None, other, offline=True, seed=7) == 0
    assert (again / "prompts.jsonl").read_bytes() == (prepped / "prompts.jsonl").read_bytes()
    first, shuffled = lines(prepped / "prompts.jsonl"), lines(other / "prompts.jsonl")
    assert [r["id"] for r in first] != [r["id"] for r in shuffled]
    assert sorted(r["id"] for r in first) == sorted(r["id"] for r in shuffled)


def test_schema_mismatch_names_source_adapter_and_keys(tmp_path, capsys):
    catalog = write_catalog(
        tmp_path,
        [
            {"name": "good", "data": str(SAMPLES / "ultrachat_200k.jsonl"), "format": "messages"},
            {"name": "math", "data": str(SAMPLES / "gsm8k.jsonl"), "format": "messages"},
        ],
    )
    out = tmp_path / "out"
    assert run_prep(catalog, out) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "source 'math': the first 30 rows gave no record with adapter 'messages'" in err
    assert "rows have keys [answer, question]" in err and "expects 'messages'" in err
    assert "missing_field 30" in err
    assert not any((out / name).exists() for name in [*OUTPUTS, "manifest.json", ".parts"])


def test_every_record_keeps_its_dataset_row_id(prepped):
    """source_id is the row's own id where the dataset has one, else its index in the file: either
    finds the very row again, and that row, prepared again, is the record."""
    from pipeline.steps.prep.adapters import ADAPTERS
    from pipeline.steps.prep.sources import conversation_record, row_source_id

    catalog = load_catalog()
    sources = {s.name: s for s in catalog.sources}
    records = lines(prepped / "prompts.jsonl") + lines(prepped / "native.jsonl")
    for record in records:
        source = sources[record["source"]]
        sample = Path(source.location(catalog.base, offline=True))
        text = sample.read_text(encoding="utf-8")
        rows = (
            json.loads(text) if sample.suffix == ".json" else [json.loads(line) for line in text.splitlines()]
        )
        found = [
            (i, row) for i, row in enumerate(rows) if row_source_id(row, source, i)[0] == record["source_id"]
        ]
        assert found, record["source_id"]  # (a duplicate row of a sample shares its id: the first is kept)
        _, row = found[0]
        again = conversation_record(ADAPTERS[source.format](row, source), source, record["source_id"])[1]
        assert again == record
    positional = {}
    for record in records:
        positional.setdefault(record["source"], set()).add(record["source_id"].startswith("#"))
    assert positional["gsm8k"] == {True} and positional["wildchat_1m"] == {False}
    swe = [r["source_id"] for r in records if r["source"] == "swe_smith_trajectories"]
    assert all(sid.count(".") == 3 for sid in swe)  # traj_id: one trajectory, not one task's instance_id
    tokenized = pq.read_table(prepped / "native_tokenized.parquet").to_pylist()
    assert [r["source_id"] for r in tokenized] == [f"#{i}" for i in range(24)]
    assert len({r["id"] for r in tokenized}) == 24


def test_unknown_speakers_are_named_with_the_roles_the_map_knows(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    turns = [{"from": "Human", "value": "hi"}, {"from": "Assistant", "value": "hello"}]
    rows.write_text(json.dumps({"conversations": turns}) + "\n")
    catalog = write_catalog(tmp_path, [{"name": "caps", "data": str(rows), "format": "sharegpt"}])
    assert run_prep(catalog, tmp_path / "out") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "(rejected: unknown_role 1); roles 'Assistant', 'Human' are not in the role map" in err
    assert (
        "which knows assistant, bing, chatgpt, function_call, gpt, human, observation, system, tool, user"
        in err
    )
    assert "e.g. roles: {Assistant: assistant, Human: user}" in err
    assert "rows have keys" not in err  # the keys were right: only the speakers were not

    # mapped as the message says, the same rows are prepared; a speaker left out is still named
    roles = {"Human": "user", "Assistant": "assistant"}
    stray = [{"from": "Human", "value": "again"}, {"from": "Bard", "value": "hi"}]
    rows.write_text("".join(json.dumps({"conversations": t}) + "\n" for t in [turns, stray]))
    catalog = write_catalog(
        tmp_path, [{"name": "caps", "data": str(rows), "format": "sharegpt", "roles": roles}]
    )
    assert run_prep(catalog, tmp_path / "out") == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "unknown_role 1 (Bard)" in err and "source 'caps': 1 rows rejected: roles 'Bard' are not" in err
    assert read_manifest(tmp_path / "out").stats["sources"]["caps"]["unknown_roles"] == {"Bard": 1}


def test_a_failed_rerun_leaves_no_manifest_over_the_old_outputs(tmp_path, capsys):
    gsm = {
        "name": "math",
        "data": str(SAMPLES / "gsm8k.jsonl"),
        "format": "pairs",
        "fields": {"prompt": "question", "response": "answer"},
    }
    out = tmp_path / "out"
    assert run_prep(write_catalog(tmp_path, [gsm]), out) == 0
    assert check_manifest(out, OUTPUTS)[0]
    broken = {**gsm, "fields": {"prompt": "input"}}  # every row now lacks its prompt
    assert run_prep(write_catalog(tmp_path, [broken]), out) == 2
    complete, why = check_manifest(out, OUTPUTS)
    assert not complete and "no valid manifest.json" in why
    assert (out / "prompts.jsonl").exists()  # the earlier outputs are not deleted, only not vouched for


def test_schema_probe_stops_a_mismatched_source_after_100_rows(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(500)))
    catalog = write_catalog(tmp_path, [{"name": "wide", "data": str(rows), "format": "sharegpt"}])
    assert run_prep(catalog, tmp_path / "out") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "the first 100 rows gave no record with adapter 'sharegpt'" in err
    assert "expects 'conversations' (a list of {from, value})" in err


def test_turn_keys_of_the_wrong_shape_are_named(tmp_path, capsys):
    catalog = write_catalog(
        tmp_path,
        [
            {
                "name": "sg",
                "data": str(SAMPLES / "sharegpt_vicuna.json"),
                "format": "messages",
                "fields": {"messages": "conversations"},
            }
        ],
    )
    assert run_prep(catalog, tmp_path / "out") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "turns have {from, value}" in err and "(a list of {role, content})" in err


def test_quota_and_cross_source_dedup(tmp_path):
    gsm = {"data": str(SAMPLES / "gsm8k.jsonl"), "format": "pairs"}
    fields = {"fields": {"prompt": "question", "response": "answer"}}
    catalog = write_catalog(
        tmp_path, [{"name": "first", **gsm, **fields}, {"name": "again", "quota": 5, **gsm, **fields}]
    )
    out = tmp_path / "out"
    assert run_prep(catalog, out) == 0
    stats = read_manifest(out).stats["sources"]
    assert stats["first"]["accepted"] == 30
    assert (
        stats["again"]["read"] == 5 and stats["again"]["accepted"] == 0 and stats["again"]["duplicates"] == 5
    )
    assert len(lines(out / "prompts.jsonl")) == 30


def test_offline_without_a_local_file_is_refused_before_any_work(tmp_path, capsys):
    catalog = write_catalog(tmp_path, [{"name": "hub", "data": "openai/gsm8k", "format": "pairs"}])
    assert run_prep(catalog, tmp_path / "out", offline=True) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "source 'hub': --offline needs a local file" in err
    assert not (tmp_path / "out").exists()


def test_default_catalog_lists_ten_sources_with_samples():
    catalog = load_catalog()
    assert len(catalog.sources) == 10
    for source in catalog.sources:
        assert Path(source.location(catalog.base, offline=True)).is_file(), source.name


def test_a_source_that_cannot_be_read_is_named_and_nothing_is_written(tmp_path, capsys, monkeypatch):
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 this is not a parquet file")
    # the hub path of the same reader, with the hub out of reach
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    catalog = write_catalog(
        tmp_path,
        [
            {
                "name": "good",
                "data": str(SAMPLES / "gsm8k.jsonl"),
                "format": "pairs",
                "fields": {"prompt": "question", "response": "answer"},
            },
            {"name": "broken", "data": str(broken), "format": "tokenized"},
            {"name": "hub", "data": "openai/gsm8k", "config": "main", "format": "pairs"},
        ],
    )
    out = tmp_path / "out"
    assert run_prep(catalog, out) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert f"error: source 'broken' ({broken}):" in err
    assert "error: source 'hub' (openai/gsm8k):" in err
    assert "prep failed: 2 of 3 sources; no output written" in err
    assert not any((out / name).exists() for name in [*OUTPUTS, "manifest.json"])


def test_malformed_rows_are_counted_not_fatal(tmp_path):
    rows = tmp_path / "rows.jsonl"
    good = {"messages": [{"role": "user", "content": "hello there"}]}
    odd = {"messages": [{"role": ["user"], "content": "a role that is a list"}]}
    not_text = {"messages": [{"role": "user", "content": {"nested": "dict"}}]}
    rows.write_text("".join(json.dumps(r) + "\n" for r in [good, odd, not_text]))
    catalog = write_catalog(tmp_path, [{"name": "odd", "data": str(rows), "format": "messages"}])
    out = tmp_path / "out"
    assert run_prep(catalog, out) == 0
    stats = read_manifest(out).stats["sources"]["odd"]
    assert stats["accepted"] == 1
    assert stats["rejected"] == {"malformed_TypeError": 1, "non_text_content": 1}


@pytest.mark.parametrize("ids", ["own ids", "positions"])
@pytest.mark.parametrize("layout", ["parquet row groups", "jsonl files"])
def test_a_source_read_in_slices_gives_the_records_and_counts_of_one_reader(layout, ids, tmp_path, capsys):
    """Two workers and one source: each reads a contiguous half of it (its parquet row groups, or
    its files). The outputs and counts are those of one worker reading it all: duplicates across
    the halves are found by the merge, rejections are counted in the half that read them, and a
    row without an id of its own is known by its index in the whole source, not in its half."""
    import pyarrow as pa

    rows = [json.loads(line) for line in (SAMPLES / "ultrachat_200k.jsonl").read_text().splitlines()]
    lone_answer = {
        "prompt_id": "lone",
        "messages": [{"role": "assistant", "content": "an answer to nothing"}],
    }
    rows += rows[:7] + [lone_answer]  # duplicates in the second half, one rejection
    if ids == "positions":
        rows = [{"messages": row["messages"]} for row in rows]
    if layout == "parquet row groups":
        data = tmp_path / "chats.parquet"
        pq.write_table(pa.Table.from_pylist(rows), data, row_group_size=8)
    else:
        data = tmp_path / "chats"
        data.mkdir()
        for number, start in enumerate(range(0, len(rows), 10)):
            part = rows[start : start + 10]
            (data / f"part-{number}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    catalog = write_catalog(tmp_path, [{"name": "chats", "data": str(data), "format": "messages"}])
    outputs = {}
    for workers in (1, 2):
        out = tmp_path / f"workers-{workers}"
        assert run_prep(catalog, out, workers=workers) == 0
        manifest = read_manifest(out)
        assert manifest.stats["parallel"]["slices"] == ({} if workers == 1 else {"chats": 2})
        assert ("chats in 2 slices" in capsys.readouterr().err) == (workers == 2)
        outputs[workers] = (
            (out / "prompts.jsonl").read_bytes(),
            {
                k: v
                for k, v in manifest.stats["sources"]["chats"].items()
                if k not in ("seconds", "worker_peak_rss")
            },
        )
        assert not (out / ".parts").exists()
    assert outputs[1] == outputs[2]
    records = [json.loads(line) for line in outputs[2][0].decode().splitlines()]
    for record in records:
        source_id = record["source_id"]
        index = int(source_id[1:]) if ids == "positions" else [r["prompt_id"] for r in rows].index(source_id)
        assert rows[index]["messages"][0]["content"] == record["messages"][0]["content"]
    if ids == "positions":  # rows of the second half are there, known by their index in the source
        assert max(int(r["source_id"][1:]) for r in records) >= len(rows) // 2
    counts = outputs[1][1]
    # the sample holds one duplicate and one prompt-less row of its own
    assert counts["duplicates"] == 1 + 7 and counts["rejected"] == {"empty_prompt": 1 + 1}
    assert counts["read"] == len(rows)


def test_tokenized_rows_read_in_slices_keep_their_index_in_the_file(tmp_path):
    import pyarrow as pa

    data = tmp_path / "tokens.parquet"
    rows = [{"input_ids": [i, i + 1, i + 2], "loss_mask": [0, 1, 1]} for i in range(40)]
    pq.write_table(pa.Table.from_pylist(rows), data, row_group_size=8)
    catalog = write_catalog(tmp_path, [{"name": "dump", "data": str(data), "format": "tokenized"}])
    tables = {}
    for workers in (1, 2):
        assert run_prep(catalog, tmp_path / f"w{workers}", workers=workers) == 0
        tables[workers] = pq.read_table(tmp_path / f"w{workers}" / "native_tokenized.parquet").to_pylist()
    assert tables[1] == tables[2]
    assert [r["source_id"] for r in tables[2]] == [f"#{i}" for i in range(40)]
    assert all(r["input_ids"][0] == int(r["source_id"][1:]) for r in tables[2])


def test_spare_workers_slice_the_sources_without_a_quota(tmp_path):
    from pipeline.steps.prep.run import plan_slices

    gsm = {"data": str(SAMPLES / "gsm8k.jsonl"), "format": "pairs"}
    catalog = load_catalog(
        write_catalog(tmp_path, [{"name": "capped", "quota": 5, **gsm}, {"name": "open", **gsm}])
    )
    assert plan_slices(catalog, 1) == plan_slices(catalog, 2) == {"capped": 1, "open": 1}
    assert plan_slices(catalog, 5) == {"capped": 1, "open": 4}


def test_online_on_a_host_that_cannot_resolve_the_hub_fails_at_once_and_says_offline(tmp_path):
    import os
    import subprocess
    import sys
    import time

    from eyrie_testing import REPO

    # .invalid never resolves (RFC 2606): the real lookup fails, as on a host without a network.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))}
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "prep", "--out-dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**env, "HF_ENDPOINT": "https://hub.invalid"},
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert time.monotonic() - started < 30  # not minutes of retries
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: the Hugging Face hub (hub.invalid) does not resolve from this host")
    assert "run `eyrie prep --offline`" in lines[0]
    assert not (tmp_path / "out").exists()
