"""Kimi's template writes a tool call's id where other templates write the function's name: with it,
every call must carry Kimi's id, ``functions.NAME:IDX``, or the name is in no token."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.steps.prep.adapters import text_of
from pipeline.steps.tokenize.tokenizer import Tokenizer

SWE_SMITH = (
    Path(__file__).resolve().parents[3] / "pipeline" / "embedded" / "samples" / "swe_smith_trajectories.jsonl"
)


def openai_messages(row: dict) -> list[dict]:
    """A SWE-smith row as OpenAI chat messages, its call ids (``call_a51d…``) as the dataset, and
    most servers, write them."""
    messages = []
    for turn in json.loads(row["messages"]):
        message = {"role": turn["role"], "content": text_of(turn["content"])}
        if turn.get("tool_calls"):
            message["tool_calls"] = turn["tool_calls"]
        if turn.get("tool_call_ids"):
            message["tool_call_id"] = turn["tool_call_ids"][0]
        messages.append(message)
    return messages


def call_headers(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """What the tokens say between each <|tool_call_begin|> and its <|tool_call_argument_begin|>."""
    begin, arguments = tokenizer.hf.convert_tokens_to_ids(
        ["<|tool_call_begin|>", "<|tool_call_argument_begin|>"]
    )
    headers, start = [], None
    for index, token in enumerate(ids):
        if token == begin:
            start = index + 1
        elif token == arguments and start is not None:
            headers.append(tokenizer.backend.decode(ids[start:index], skip_special_tokens=False))
            start = None
    return headers


def test_a_swe_smith_row_names_its_functions_in_the_kimi_tokens(kimi_tokenizer):
    row = json.loads(SWE_SMITH.read_text(encoding="utf-8").splitlines()[0])
    messages = openai_messages(row)
    calls = [call for m in messages for call in m.get("tool_calls", [])]
    names = [call["function"]["name"] for call in calls]
    assert len(names) >= 3 and all(call["id"].startswith("call_") for call in calls)
    tokenizer = Tokenizer(kimi_tokenizer, "kimi-k2")
    assert tokenizer.template.names_calls_by_id
    ((ids, mask, _),) = tokenizer.encode_batch([(messages, None)])
    expected = [f"functions.{name}:{index}" for index, name in enumerate(names)]
    assert call_headers(tokenizer, ids) == expected
    text = tokenizer.backend.decode(ids, skip_special_tokens=False)
    assert all(f"## Return of {call_id}" in text for call_id in expected)  # results answer the renamed calls
    assert not any(call["id"] in text for call in calls)


def test_prepped_swe_smith_rows_name_their_functions_with_the_kimi_template(
    kimi_tokenizer, sample_conversations
):
    tokenizer = Tokenizer(kimi_tokenizer, "kimi-k2")
    swe = [record for name, record in sample_conversations if name == "swe_smith_trajectories"]
    encoded = tokenizer.encode_batch([(record["conversations"], record.get("tools")) for record in swe])
    assert len(swe) == 10
    for record, (ids, _, _) in zip(swe, encoded, strict=True):
        calls = [call for m in record["conversations"] for call in m.get("tool_calls", [])]
        names = [call["function"]["name"] for call in calls]
        assert call_headers(tokenizer, ids) == [f"functions.{n}:{i}" for i, n in enumerate(names)]


def test_templates_that_write_the_name_keep_the_ids(tiny_tokenizer):
    tokenizer = Tokenizer(tiny_tokenizer, "tokenizer")  # ChatML with hermes-style <tool_call>{"name": …}
    assert not tokenizer.template.names_calls_by_id
