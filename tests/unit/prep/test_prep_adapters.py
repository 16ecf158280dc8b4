"""Adapters by row shape: reasoning split, tool calls (OpenAI and hermes text), roles, rejections."""

from __future__ import annotations

import json

import pytest

from pipeline.steps.chat_format import kimi_tool_call_ids
from pipeline.steps.prep.adapters import (
    Reject,
    adapt_messages,
    adapt_pairs,
    adapt_sharegpt,
    adapt_tokenized,
    split_reasoning,
)
from pipeline.steps.prep.catalog import Source
from pipeline.steps.prep.run import merge_jsonl
from pipeline.steps.prep.sources import conversation_record, prepare_source, record_line, row_source_id


def source(fmt: str, **extra) -> Source:
    return Source(name="s", data="x.jsonl", format=fmt, **extra)


@pytest.mark.parametrize(
    ("text", "reasoning", "answer"),
    [
        ("<think>\nstep 1\n</think>\n\nThe answer is 4.", "step 1", "The answer is 4."),
        ("  <think>a</think>b", "a", "b"),
        ("<think>\ncut off while thinking", "cut off while thinking", ""),
        (
            "<|begin_of_thought|>\n\nhmm\n\n<|end_of_thought|>\n\n<|begin_of_solution|>\n\n156\n\n"
            "<|end_of_solution|>",
            "hmm",
            "156",
        ),
        (
            "No reasoning here. <think>not a block</think>",
            None,
            "No reasoning here. <think>not a block</think>",
        ),
    ],
)
def test_split_reasoning(text, reasoning, answer):
    assert split_reasoning(text) == (reasoning, answer)


def test_messages_json_string_with_tool_calls_and_text_parts():
    turns = [
        {"role": "system", "content": [{"type": "text", "text": "sys"}]},
        {"role": "user", "content": "fix it"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "looking"}],
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": {"c": 1}}}
            ],
        },
        {"role": "tool", "content": "ok", "tool_call_ids": ["call_1"]},
    ]
    conv = adapt_messages({"messages": json.dumps(turns)}, source("messages"))
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "tool"]
    assert conv.messages[0]["content"] == "sys"
    call = conv.messages[2]["tool_calls"][0]
    assert call == {
        "id": "functions.bash:0",  # Kimi's form: the id names the function
        "type": "function",
        "function": {"name": "bash", "arguments": '{"c": 1}'},
    }
    assert conv.messages[3] == {"role": "tool", "content": "ok", "tool_call_id": "functions.bash:0"}


def call(call_id, name):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}


def test_openai_call_ids_become_kimi_ids_counted_across_the_conversation():
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [call("call_1", "bash"), call("call_2", "view")]},
        {"role": "tool", "content": "viewed", "tool_call_id": "call_2"},  # answers out of order
        {"role": "tool", "content": "ran"},  # no id: the call left unanswered
        {"role": "assistant", "content": "", "tool_calls": [call("call_1", "bash")]},  # an id reused
        {"role": "tool", "content": "ran again", "tool_call_id": "call_1"},
    ]
    out = kimi_tool_call_ids(messages)
    ids = [c["id"] for m in out for c in m.get("tool_calls", [])]
    assert ids == ["functions.bash:0", "functions.view:1", "functions.bash:2"]
    answers = [m["tool_call_id"] for m in out if m["role"] == "tool"]
    assert answers == ["functions.view:1", "functions.bash:0", "functions.bash:2"]
    assert messages[1]["tool_calls"][0]["id"] == "call_1"  # the input is left as it was


def test_ids_already_in_kimi_form_are_kept_as_the_target_wrote_them():
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [call("functions.bash:3", "bash")]},
        {"role": "tool", "content": "ran", "tool_call_id": "functions.bash:3"},
    ]
    assert kimi_tool_call_ids(messages) == messages
    mixed = [*messages, {"role": "assistant", "content": "", "tool_calls": [call("call_9", "view")]}]
    assert [c["id"] for m in kimi_tool_call_ids(mixed) for c in m.get("tool_calls", [])] == [
        "functions.bash:0",
        "functions.view:1",
    ]


def test_sharegpt_hermes_tool_calls_become_structured():
    row = {
        "conversations": [
            {"from": "human", "value": "disk?"},
            {
                "from": "gpt",
                "value": "<think>\ncheck\n</think>\n\n"
                '<tool_call>\n{"name": "terminal", "arguments": {"command": "df"}}\n</tool_call>\n'
                '<tool_call>\n{"name": "terminal", "arguments": {"command": "du"}}\n</tool_call>',
            },
            {
                "from": "tool",
                "value": "<tool_response>\nA\n</tool_response>\n<tool_response>\nB\n</tool_response>",
            },
            {"from": "gpt", "value": "<think>done</think>\n\n468 GB free"},
        ],
        "tools": json.dumps([{"type": "function", "function": {"name": "terminal"}}]),
    }
    conv = adapt_sharegpt(row, source("sharegpt"))
    first = conv.messages[1]
    assert first["reasoning_content"] == "check" and first["content"] == ""
    assert [c["id"] for c in first["tool_calls"]] == ["functions.terminal:0", "functions.terminal:1"]
    assert first["tool_calls"][1]["function"]["arguments"] == '{"command": "du"}'
    assert conv.messages[2] == {"role": "tool", "content": "A", "tool_call_id": "functions.terminal:0"}
    assert conv.messages[3] == {"role": "tool", "content": "B", "tool_call_id": "functions.terminal:1"}
    assert conv.messages[4] == {"role": "assistant", "content": "468 GB free", "reasoning_content": "done"}
    assert conv.tools == [{"type": "function", "function": {"name": "terminal"}}]


def test_sharegpt_top_level_system_and_role_map():
    row = {"system": "be brief", "conversations": [{"from": "person", "value": "hi"}]}
    conv = adapt_sharegpt(row, source("sharegpt", roles={"person": "user"}))
    assert conv.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with pytest.raises(Reject, match="unknown_role") as rejected:
        adapt_sharegpt(row, source("sharegpt"))
    assert rejected.value.names == ("person",)  # the speakers the map lacks, for the error to name


def test_broken_hermes_call_is_rejected():
    row = {
        "conversations": [
            {"from": "human", "value": "x"},
            {"from": "gpt", "value": "<tool_call>{bad</tool_call>"},
        ]
    }
    with pytest.raises(Reject, match="bad_tool_call"):
        adapt_sharegpt(row, source("sharegpt"))


def test_pairs_with_field_overrides():
    src = source("pairs", fields={"prompt": "question", "response": "answer"})
    conv = adapt_pairs({"question": "2+2?", "answer": "4"}, src)
    assert conv.messages == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    with pytest.raises(Reject, match="missing_field"):
        adapt_pairs({"input": "2+2?"}, src)


def test_tokenized_rows_are_checked():
    src = source("tokenized")
    assert adapt_tokenized({"input_ids": [5, 6], "loss_mask": [0, 1]}, src).loss_mask == [0, 1]
    with pytest.raises(Reject, match="mask_length_mismatch"):
        adapt_tokenized({"input_ids": [5, 6], "loss_mask": [1]}, src)
    with pytest.raises(Reject, match="no_assistant_tokens"):
        adapt_tokenized({"input_ids": [5, 6], "loss_mask": [0, 0]}, src)


def test_prompt_records_end_before_the_answer_and_ids_are_stable():
    src = source("messages")
    row = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"},
        ]
    }
    key, record, rest = conversation_record(adapt_messages(row, src), src, "row-7")
    assert json.loads(record_line(json.dumps("row-7").encode(), rest.encode())) == record
    assert record["source_id"] == "row-7"
    assert [m["content"] for m in record["messages"]] == ["a", "b", "c"]
    again = conversation_record(adapt_messages(row, src), src, "row-7")
    renamed = src.model_copy(update={"name": "t"})
    other = conversation_record(adapt_messages(row, renamed), renamed, "row-7")
    assert again == (key, record, rest)
    assert conversation_record(adapt_messages(row, src), src, "row-8")[1]["id"] == record["id"]
    assert other[1]["id"] != record["id"]  # the id names the source ...
    assert other[0] == key  # ... the dedup key does not, so duplicates are found across sources


def test_a_first_turn_prompt_is_the_opening_question_after_its_system_message():
    src = source("messages", prompt="first_turn")
    row = {
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ]
    }
    _, record, _ = conversation_record(adapt_messages(row, src), src, "#0")
    assert [(m["role"], m["content"]) for m in record["messages"]] == [("system", "s"), ("user", "a")]
    last = conversation_record(adapt_messages(row, source("messages")), source("messages"), "#0")[1]
    assert [m["content"] for m in last["messages"]] == ["s", "a", "b", "c"]
    assert record["id"] != last["id"]  # another prompt, another id
    opened_by_an_answer = {"messages": [{"role": "assistant", "content": "hi"}, *row["messages"][1:]]}
    _, record, _ = conversation_record(adapt_messages(opened_by_an_answer, src), src, "#0")
    assert [(m["role"], m["content"]) for m in record["messages"]] == [("user", "a")]
    with pytest.raises(Reject, match="empty_prompt"):
        only_system = {"messages": row["messages"][:1]}
        conversation_record(adapt_messages(only_system, src), src, "#0")


def test_native_records_keep_the_answer_and_need_one():
    src = source("messages", native=True)
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert conversation_record(adapt_messages(row, src), src, "#0")[1]["conversations"][-1]["content"] == "a"
    opened_by_an_answer = {"messages": [{"role": "assistant", "content": "hello"}, *row["messages"]]}
    kept = conversation_record(adapt_messages(opened_by_an_answer, src), src, "#0")[1]["conversations"]
    assert [m["content"] for m in kept] == ["q", "a"]
    with pytest.raises(Reject, match="no_assistant_turn"):
        conversation_record(adapt_messages({"messages": row["messages"][:1]}, src), src, "#0")


def test_length_filters():
    row = {"messages": [{"role": "user", "content": "x" * 50}]}
    with pytest.raises(Reject, match="too_long"):
        conversation_record(adapt_messages(row, source("messages")), source("messages", max_chars=10), "#0")
    with pytest.raises(Reject, match="too_short"):
        conversation_record(adapt_messages(row, source("messages")), source("messages", min_chars=100), "#0")


@pytest.mark.parametrize(
    ("row", "fields", "expected"),
    [
        ({"id": "aeb5ad_0", "prompt_id": "p"}, {}, ("aeb5ad_0", False)),  # `id` first
        ({"conversation_hash": "9bf8"}, {}, ("9bf8", False)),  # WildChat
        ({"instance_id": "pydantic__1", "traj_id": "pydantic__1.8dead"}, {}, ("pydantic__1.8dead", False)),
        ({"id": 1234}, {}, ("1234", False)),  # numeric ids are kept, as text
        ({"id": "", "prompt_id": "p"}, {}, ("p", False)),  # an empty id is no id
        ({"question": "2+2?"}, {}, ("#17", True)),  # none: the row's index in the source
        ({"question": "2+2?", "qid": "q-5"}, {"id": "qid"}, ("q-5", False)),  # a column the catalog names
    ],
)
def test_a_row_keeps_its_own_id_or_its_position(row, fields, expected):
    assert row_source_id(row, source("pairs", fields=fields), 17) == expected


def test_an_id_column_the_catalog_names_must_be_there():
    with pytest.raises(Reject, match="missing_id"):
        row_source_id({"question": "2+2?"}, source("pairs", fields={"id": "qid"}), 0)


def test_a_row_s_position_travels_outside_its_record_and_the_merge_writes_its_source_id_once(tmp_path):
    rows = [{"prompt": f"question {i}?", "response": "r"} for i in range(6)]  # no id of their own
    rows[2]["id"] = "own-2"
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = Source(name="s", data=str(data), format="pairs")
    result = prepare_source(src, str(data), tmp_path / "part", probe_rows=10)
    assert result.error is None and result.accepted == 6, result
    lines = (tmp_path / "part").read_bytes().splitlines()
    fields = [line.split(b"\t", 2) for line in lines]
    # The position is a field of the part line; the record after it holds no source_id to patch.
    assert [f[1] for f in fields] == [b"0", b"1", b'"own-2"', b"3", b"4", b"5"]
    assert not any(b"source_id" in f[2] for f in fields)
    # As a later slice of its source, after 100 rows of the slices before it:
    before = tmp_path / "before"
    before.write_bytes(b"")
    result.parts, result.part_rows = [str(before), str(tmp_path / "part")], [100, 6]
    assert merge_jsonl([result], "prompts", tmp_path / "prompts.jsonl", seed=0) == 6
    merged = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    by_question = {r["messages"][-1]["content"]: r["source_id"] for r in merged}
    assert by_question == {f"question {i}?": "own-2" if i == 2 else f"#{100 + i}" for i in range(6)}
