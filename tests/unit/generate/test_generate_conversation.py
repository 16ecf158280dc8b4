"""What each mode asks the target, and how the answers become the output conversation."""

from __future__ import annotations

import pytest

from pipeline.steps.generate.conversation import Plan, PromptError, output_row

TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def run_plan(plan: Plan) -> list[list[dict]]:
    """Drive a plan with a scripted server; returns the histories it asked about."""
    asked = []
    while (history := plan.next_history()) is not None:
        asked.append([dict(m) for m in history])
        plan.feed({"role": "assistant", "content": f"new{len(asked)}", "reasoning_content": "r"})
    return asked


def test_last_turn_regenerates_only_the_final_answer_and_keeps_history():
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "old1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "old2"},
    ]
    plan = Plan(messages, "last_turn")
    asked = run_plan(plan)
    assert asked == [messages[:4]]
    assert [m["content"] for m in plan.conversation] == ["sys", "q1", "old1", "q2", "new1"]
    assert plan.conversation[-1]["reasoning_content"] == "r"


def test_last_turn_answers_a_row_that_ends_with_the_user():
    plan = Plan([{"role": "user", "content": "q"}], "last_turn")
    assert run_plan(plan) == [[{"role": "user", "content": "q"}]]
    assert plan.conversation[-1]["content"] == "new1"


def test_all_turns_rebuilds_history_from_regenerated_answers():
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "old1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "old2"},
        {"role": "user", "content": "q3"},
    ]
    plan = Plan(messages, "all_turns")
    asked = run_plan(plan)
    assert [[m["content"] for m in h] for h in asked] == [
        ["q1"],
        ["q1", "new1", "q2"],
        ["q1", "new1", "q2", "new2", "q3"],
    ]
    assert not plan.fell_back and plan.mode == "all_turns"
    assert [m["content"] for m in plan.conversation] == ["q1", "new1", "q2", "new2", "q3", "new3"]


def test_all_turns_falls_back_to_last_turn_for_tool_rows_and_passes_tool_messages_through():
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ]
    plan = Plan(messages, "all_turns")
    asked = run_plan(plan)
    assert plan.fell_back and plan.mode == "last_turn"
    assert asked == [
        [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "tool_calls": [TOOL_CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]
    ]
    row = output_row({"id": "x", "source": "s"}, plan, ["stop"])
    # SpecForge reads content as a string: a tool-calling turn gets "" instead of None.
    assert row["conversations"][1] == {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]}
    assert row["conversations"][-1]["content"] == "new1"


def test_output_row_flags_length_in_any_turn():
    plan = Plan([{"role": "user", "content": "q"}], "last_turn")
    run_plan(plan)
    row = output_row({"id": "a", "source": "s"}, plan, ["length"])
    assert row["truncated"] is True and row["finish_reason"] == "length"
    assert row["id"] == "a" and row["source"] == "s" and row["mode"] == "last_turn"


def test_server_reasoning_field_and_tool_calls_are_kept():
    plan = Plan([{"role": "user", "content": "q"}], "last_turn")
    plan.next_history()
    plan.feed({"role": "assistant", "content": None, "reasoning": "hmm", "tool_calls": [TOOL_CALL]})
    assert plan.conversation[-1] == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "hmm",
        "tool_calls": [TOOL_CALL],
    }


@pytest.mark.parametrize(
    "messages",
    [[], [{"role": "assistant", "content": "a"}], [{"role": "wizard", "content": "x"}]],
)
def test_rows_that_cannot_be_asked_are_refused(messages):
    with pytest.raises(PromptError):
        Plan(messages, "last_turn")
