"""The one-pass loss mask equals a slow reference (per-turn prefix tokenization), token for token.

Every sample conversation of the default catalog, answers included, through both
span methods: the embedded tokenizer's own template and the shipped Kimi-K2-style
template (generation markers), and the embedded template without its markers
(spans from rendered prefixes).
"""

from __future__ import annotations

import pytest

from pipeline.steps.tokenize.chat_template import render
from pipeline.steps.tokenize.loss_mask import mask_from_offsets
from pipeline.steps.tokenize.tokenizer import Tokenizer


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def reference_mask(tokenizer: Tokenizer, messages: list[dict], tools) -> tuple[list[int], list[int]]:
    """Tokenize the prefix before each assistant turn and the prefix through it; mark the difference.

    Where BPE merges across a turn boundary (the ChatML template writes "assistant\n" then "\n<tool_call>"
    for a turn with no text, and "\n\n" is one token), the prefix's tokens stop being a prefix of the
    whole: the token that straddles the boundary holds assistant characters, so it is marked.
    """

    def ids(text: str) -> list[int]:
        return tokenizer.backend.encode(text, add_special_tokens=False).ids

    full, _ = render(tokenizer.template, messages, tools, special=tokenizer.special)
    full_ids = ids(full)
    mask = [0] * len(full_ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = ids(render(tokenizer.template, messages[:i], tools, True, tokenizer.special)[0])
        through = ids(render(tokenizer.template, messages[: i + 1], tools, False, tokenizer.special)[0])
        start = common_prefix(before, full_ids)
        stable_end = common_prefix(through, full_ids)
        end = stable_end if stable_end == len(through) else stable_end + 1
        for position in range(start, end):
            mask[position] = 1
    return full_ids, mask


@pytest.mark.parametrize("template", ["tokenizer", "kimi-k2", "unmarked"])
def test_one_pass_mask_matches_prefix_reference_on_every_sample(
    template, tiny_tokenizer, kimi_tokenizer, unmarked_template, sample_conversations
):
    folder = kimi_tokenizer if template == "kimi-k2" else tiny_tokenizer
    tokenizer = Tokenizer(folder, str(unmarked_template) if template == "unmarked" else template)
    assert tokenizer.template.method == ("message_probes" if template == "unmarked" else "generation_markers")
    batch = [(record["conversations"], record.get("tools")) for _, record in sample_conversations]
    assert len(batch) > 200 and len({name for name, _ in sample_conversations}) == 9
    encoded = tokenizer.encode_batch(batch)
    pieces = 0
    for (name, record), result, (messages, tools) in zip(sample_conversations, encoded, batch, strict=True):
        assert not isinstance(result, str), (name, record["id"], result)
        ids, mask, in_pieces = result
        pieces += in_pieces
        expected_ids, expected_mask = reference_mask(tokenizer, messages, tools)
        assert ids == expected_ids, (name, record["id"])
        assert mask == expected_mask, (name, record["id"])
        assert 0 < sum(mask) < len(mask)
    # Kimi's spans start after <|im_middle|> and end with <|im_end|>: every conversation goes in
    # pieces. ChatML's start after "assistant\n": in pieces only where each turn opens with <think>.
    if template == "kimi-k2":
        assert pieces == len(batch)
    else:
        assert 0 < pieces < len(batch)


def test_kimi_mask_covers_reasoning_tool_calls_and_end_of_turn_only(kimi_tokenizer):
    tokenizer = Tokenizer(kimi_tokenizer, "kimi-k2")
    messages = [
        {"role": "user", "content": "disk?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "use df",
            "tool_calls": [
                {
                    "id": "functions.terminal:0",
                    "type": "function",
                    "function": {"name": "terminal", "arguments": '{"command": "df"}'},
                }
            ],
        },
        {"role": "tool", "content": "468G free", "tool_call_id": "functions.terminal:0"},
        {"role": "assistant", "content": "468 GB free."},
    ]
    ((ids, mask, _),) = tokenizer.encode_batch([(messages, None)])
    decode = tokenizer.hf.decode
    masked = decode([i for i, m in zip(ids, mask, strict=True) if m])
    unmasked = decode([i for i, m in zip(ids, mask, strict=True) if not m])
    assert masked == (
        "<think>use df</think><|tool_calls_section_begin|><|tool_call_begin|>functions.terminal:0"
        '<|tool_call_argument_begin|>{"command": "df"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        "468 GB free.<|im_end|>"
    )
    assert (
        "disk?" in unmasked
        and "468G free" in unmasked
        and "<|im_assistant|>assistant<|im_middle|>" in unmasked
    )


def test_mask_from_offsets_marks_tokens_overlapping_spans():
    offsets = [(0, 3), (3, 5), (5, 9), (9, 10), (10, 14)]
    assert mask_from_offsets(offsets, [(4, 9)]) == [0, 1, 1, 0, 0]
    assert mask_from_offsets(offsets, [(0, 3), (9, 14)]) == [1, 0, 0, 1, 1]
    assert mask_from_offsets(offsets, []) == [0, 0, 0, 0, 0]
