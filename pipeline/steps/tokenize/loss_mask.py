"""The loss mask: the character spans of the assistant's output in a rendered conversation, and
the tokens that overlap them.

The mask marks what the assistant produces (reasoning, text, tool calls, its end-of-turn token)
and nothing else. It comes from ONE rendering and ONE tokenization per conversation: the chat
template yields the character spans of the assistant's output, the tokenizer yields each token's
character offsets, and a single sweep over both marks the tokens that overlap a span. Cost is
linear in the conversation's length; no prefix is ever tokenized again.

Spans come from ``{% generation %}`` markers when the template has them (the shipped
Kimi-K2-style template does). A template without markers (Kimi-K2.5's own) gets them from
per-message probes, each at most two messages long, checked against the whole rendering (still
linear); a conversation the template does not render message by message falls back to rendered
prefixes, and the manifest says which method ran.
"""

from __future__ import annotations

from typing import Any

from pipeline.steps.tokenize.chat_template import ChatTemplate, TokenizeError, render, render_all


def _prefixes_differ(template: ChatTemplate) -> TokenizeError:
    return TokenizeError(
        f"chat template {template.name!r} renders a conversation's prefixes differently from the "
        "whole; add {% generation %} markers around the assistant's output"
    )


def prefix_spans(
    template: ChatTemplate, messages: list[dict], tools: Any, special: dict, text: str
) -> list[tuple[int, int]]:
    """Each assistant message's span from the conversation rendered up to it (with the generation
    prompt) and through it: exact for any template whose prefixes render as the whole begins,
    but the rendering grows with the square of the turns."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, _ = render(template, messages[:i], tools, generation_prompt=True, special=special)
        through, _ = render(template, messages[: i + 1], tools, special=special)
        if not (text.startswith(through) and through.startswith(before)):
            raise _prefixes_differ(template)
        spans.append((len(before), len(through)))
    return spans


PROBE_WINDOWS = (0, 1)
"""How many messages before each one its probe renders, tried in turn: none (one short render per
message), then the one before it (for templates that render a message by the one before it)."""


def probe_spans(
    template: ChatTemplate, messages: list[dict], tools: Any, special: dict, text: str, window: int = 0
) -> list[tuple[int, int]] | None:
    """The prefix method's spans in linear time, or None where this conversation cannot have them so.

    Each message is rendered after the ``window`` messages before it alone (the first after
    nothing): what it adds to that short context is its own text; for an assistant message,
    what the generation prompt adds to the message before it alone is its header. The whole
    conversation must then read as the first message's rendering followed by the others'
    texts, character for character, and each assistant text must open with its header; only
    then are the spans (each assistant text less its header, at its place in the whole) the
    ones the prefix method finds. No probe is longer than ``window + 1`` messages, whatever
    the conversation's length.
    """
    if not messages:
        return []

    def key(start: int, end: int) -> tuple[int, int]:
        return (start, end) if end > start else (0, 0)  # every empty context renders alike

    assistant = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
    ahead = [max(0, j - window) for j in range(len(messages))]
    wanted = {key(ahead[j], j + 1) for j in range(len(messages))}
    wanted |= {key(ahead[j], j) for j in range(1, len(messages))}
    wanted |= {key(max(0, j - 1), j) for j in assistant if j}
    plain_keys = sorted(wanted)
    prompt_keys = [key(max(0, j - 1), j) for j in assistant]
    try:
        rendered, _ = render_all(template, [messages[a:b] for a, b in plain_keys], tools, special=special)
        prompts = render_all(template, [messages[a:b] for a, b in prompt_keys], tools, True, special)[0]
    except Exception:  # a context the template cannot open with (e.g. it reads messages[0] of none)
        return None
    plain = dict(zip(plain_keys, rendered, strict=True))
    pieces = [plain[key(0, 1)]]  # the first message with all that comes before it (system, tools)
    for j in range(1, len(messages)):
        through, context = plain[key(ahead[j], j + 1)], plain[key(ahead[j], j)]
        if not through.startswith(context):
            return None
        pieces.append(through[len(context) :])
    if "".join(pieces) != text:
        return None
    spans, offset = [], 0
    headers = dict(zip(assistant, prompts, strict=True))
    for j, piece in enumerate(pieces):
        if j in headers:
            context = plain[key(j - 1, j)] if j else ""
            if not headers[j].startswith(context):
                return None
            header = headers[j][len(context) :]
            if not piece.startswith(header):
                return None
            spans.append((offset + len(header), offset + len(piece)))
        offset += len(piece)
    return spans


def assistant_spans(
    template: ChatTemplate, messages: list[dict], tools: Any, special: dict
) -> tuple[str, list[tuple[int, int]], bool]:
    """The rendered conversation, the character spans of the assistant's output in order, and
    whether they took the rendered prefixes (a template that does not render message by message)."""
    text, spans = render(template, messages, tools, special=special)
    if template.markers:
        return text, spans, False
    for window in PROBE_WINDOWS:
        probed = probe_spans(template, messages, tools, special, text, window)
        if probed is not None:
            return text, probed, False
    return text, prefix_spans(template, messages, tools, special, text), True


def mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token overlapping a span; one sweep, as both lists are in order."""
    mask = [0] * len(offsets)
    span = 0
    for index, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0]:
            mask[index] = 1
    return mask


def span_mask(encoding: Any, spans: list[tuple[int, int]]) -> list[int]:
    """The mask of one encoding: per span, the tokens holding its first and last characters and all
    between. Same rule as ``mask_from_offsets`` in O(spans) lookups instead of a pass over all
    offsets; a character no token covers (a normalizer dropped it) falls back to the sweep."""
    mask = [0] * len(encoding.ids)
    for start, end in spans:
        if start >= end:
            continue
        first, last = encoding.char_to_token(start), encoding.char_to_token(end - 1)
        if first is None or last is None:
            return mask_from_offsets(encoding.offsets, spans)
        mask[first : last + 1] = [1] * (last + 1 - first)
    return mask
