"""Adapters by row shape: each turns one dataset row into chat messages, or rejects it with a reason.

Shapes, not datasets: ``messages`` (role/content, OpenAI tool calls, possibly a
JSON string), ``sharegpt`` (from/value with a role map, an optional top-level
system column, hermes-style ``<tool_call>`` text), ``pairs`` (one prompt field,
one response field) and ``tokenized`` (``input_ids`` + ``loss_mask``).
Every message comes out as ``{role, content, reasoning_content?, tool_calls?,
tool_call_id?}`` with roles system/user/assistant/tool; reasoning blocks
(``<think>``, ``<|begin_of_thought|>``) are split out into ``reasoning_content``.
Tool calls carry Kimi's ids (``chat_format.kimi_tool_call_ids``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pipeline.steps.chat_format import Message, kimi_tool_call_ids
from pipeline.steps.prep.catalog import Source


class Reject(Exception):
    """A row that yields no record; ``reason`` is the counter it is filed under, ``names`` what in
    the row caused it, where that helps fix the catalog (the speakers the role map lacks)."""

    def __init__(self, reason: str, names: tuple[str, ...] = ()):
        super().__init__(reason)
        self.reason = reason
        self.names = names


def _unknown_roles(turns: list, key: str, roles: dict[str, str]) -> Reject:
    """The rejection of a row with speakers the role map lacks, naming every one of them."""
    names = {str(t[key]) for t in turns if isinstance(t, dict) and key in t and t[key] not in roles}
    return Reject("unknown_role", tuple(sorted(names)))


@dataclass
class Conversation:
    messages: list[Message]
    tools: list[dict] | None = None


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]
    extra: dict[str, Any] = field(default_factory=dict)


# Reasoning markers of the sources in the default catalog: (open, close, answer wrapper).
_REASONING_STYLES = [
    ("<think>", "</think>", None),
    ("<|begin_of_thought|>", "<|end_of_thought|>", ("<|begin_of_solution|>", "<|end_of_solution|>")),
]
_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_TOOL_RESPONSE_RE = re.compile(r"<tool_response>\s*(.*?)\s*</tool_response>", re.DOTALL)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """``(reasoning, answer)`` from an assistant text that opens with a reasoning block.

    An unterminated block (a reply cut off while thinking) is all reasoning.
    """
    stripped = text.lstrip()
    for open_tag, close_tag, wrapper in _REASONING_STYLES:
        if not stripped.startswith(open_tag):
            continue
        body = stripped[len(open_tag) :]
        reasoning, closed, answer = body.partition(close_tag)
        if not closed:
            return reasoning.strip(), ""
        answer = answer.strip()
        if wrapper and answer.startswith(wrapper[0]):
            answer = answer[len(wrapper[0]) :].partition(wrapper[1])[0].strip()
        return reasoning.strip(), answer
    return None, text.strip()


def text_of(content: Any) -> str:
    """Message content as text: a string, ``None``, or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise Reject("non_text_content")
        return "".join(parts)
    raise Reject("non_text_content")


def _arguments(value: Any) -> str:
    """Tool-call arguments as a JSON string (datasets store both strings and objects)."""
    if isinstance(value, str):
        return value
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


def _openai_tool_calls(raw: Any) -> list[dict]:
    if not raw:
        return []
    if not isinstance(raw, list):
        raise Reject("bad_tool_call")
    calls = []
    for call in raw:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not function.get("name"):
            raise Reject("bad_tool_call")
        calls.append(
            {
                "id": call.get("id"),  # rewritten by kimi_tool_call_ids
                "type": "function",
                "function": {"name": function["name"], "arguments": _arguments(function.get("arguments"))},
            }
        )
    return calls


def _hermes_tool_calls(text: str, counter: list[int]) -> tuple[str, list[dict]]:
    """Pull ``<tool_call>{json}</tool_call>`` blocks out of an assistant text as structured calls."""
    calls = []
    for match in _TOOL_CALL_RE.finditer(text):
        try:
            payload = json.loads(match.group(1))
        except json.JSONDecodeError:
            raise Reject("bad_tool_call") from None
        if not isinstance(payload, dict) or not payload.get("name"):
            raise Reject("bad_tool_call")
        name = payload["name"]
        calls.append(
            {
                "id": f"functions.{name}:{counter[0]}",
                "type": "function",
                "function": {"name": name, "arguments": _arguments(payload.get("arguments"))},
            }
        )
        counter[0] += 1
    return _TOOL_CALL_RE.sub("", text).strip(), calls


def _assistant(text: str, reasoning: Any = None, tool_calls: list[dict] | None = None) -> Message:
    found, answer = split_reasoning(text)
    reasoning_text = text_of(reasoning).strip() if reasoning else found
    message: Message = {"role": "assistant", "content": answer}
    if reasoning_text:
        message["reasoning_content"] = reasoning_text
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def _load_list(row: dict, key: str) -> list:
    if key not in row:
        raise Reject("missing_field")
    value = row[key]
    if isinstance(value, str):  # some datasets store the conversation as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise Reject("bad_json") from None
    if not isinstance(value, list):
        raise Reject("not_a_list")
    return value


def _tools(row: dict, key: str) -> list[dict] | None:
    value = row.get(key)
    if value in (None, "", []):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise Reject("bad_json") from None
    if not isinstance(value, list):
        raise Reject("bad_tools")
    return value


def _system(row: dict, key: str) -> list[Message]:
    value = row.get(key)
    return [{"role": "system", "content": value}] if isinstance(value, str) and value.strip() else []


def adapt_messages(row: dict, source: Source) -> Conversation:
    turns = _load_list(row, source.field("messages"))
    roles = source.role_map()
    messages = _system(row, source.field("system"))
    for turn in turns:
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise Reject("bad_turn_keys")
        role = roles.get(turn["role"])
        if role is None:
            raise _unknown_roles(turns, "role", roles)
        text = text_of(turn["content"])
        if role == "assistant":
            calls = _openai_tool_calls(turn.get("tool_calls"))
            messages.append(_assistant(text, turn.get("reasoning_content"), calls))
        elif role == "tool":
            call_id = turn.get("tool_call_id") or (turn.get("tool_call_ids") or [None])[0]
            message = {"role": "tool", "content": text}
            if call_id:
                message["tool_call_id"] = call_id
            messages.append(message)
        else:
            messages.append({"role": role, "content": text})
    return Conversation(kimi_tool_call_ids(messages), _tools(row, source.field("tools")))


def adapt_sharegpt(row: dict, source: Source) -> Conversation:
    turns = _load_list(row, source.field("messages"))
    roles = source.role_map()
    messages = _system(row, source.field("system"))
    counter = [0]
    pending_ids: list[str] = []
    for turn in turns:
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise Reject("bad_turn_keys")
        role = roles.get(turn["from"])
        if role is None:
            raise _unknown_roles(turns, "from", roles)
        text = text_of(turn["value"])
        if role == "assistant":
            answer, calls = _hermes_tool_calls(text, counter)
            pending_ids = [c["id"] for c in calls]
            messages.append(_assistant(answer, None, calls))
        elif role == "tool":
            responses = _TOOL_RESPONSE_RE.findall(text) or [text.strip()]
            for response in responses:
                message = {"role": "tool", "content": response}
                if pending_ids:
                    message["tool_call_id"] = pending_ids.pop(0)
                messages.append(message)
        else:
            messages.append({"role": role, "content": text})
    return Conversation(messages, _tools(row, source.field("tools")))


def adapt_pairs(row: dict, source: Source) -> Conversation:
    prompt_key, response_key = source.field("prompt"), source.field("response")
    if prompt_key not in row:
        raise Reject("missing_field")
    messages = _system(row, source.field("system"))
    messages.append({"role": "user", "content": text_of(row[prompt_key])})
    response = row.get(response_key)
    if response is not None:
        messages.append(_assistant(text_of(response)))
    return Conversation(messages)


def adapt_tokenized(row: dict, source: Source) -> Tokenized:
    ids_key, mask_key = source.field("input_ids"), source.field("loss_mask")
    if ids_key not in row or mask_key not in row:
        raise Reject("missing_field")
    ids, mask = row[ids_key], row[mask_key]
    if not isinstance(ids, list) or not isinstance(mask, list):
        raise Reject("not_a_list")
    if len(ids) != len(mask):
        raise Reject("mask_length_mismatch")
    if not ids or not any(mask):
        raise Reject("no_assistant_tokens")
    return Tokenized([int(i) for i in ids], [1 if m else 0 for m in mask])


ADAPTERS = {
    "messages": adapt_messages,
    "sharegpt": adapt_sharegpt,
    "pairs": adapt_pairs,
    "tokenized": adapt_tokenized,
}


def expected_keys(source: Source) -> str:
    """What the adapter looks for, as a schema-mismatch error states it."""
    if source.format == "messages":
        return f"{source.field('messages')!r} (a list of {{role, content}})"
    if source.format == "sharegpt":
        return f"{source.field('messages')!r} (a list of {{from, value}})"
    if source.format == "pairs":
        return f"{source.field('prompt')!r} and {source.field('response')!r}"
    return f"{source.field('input_ids')!r} and {source.field('loss_mask')!r}"


def found_keys(row: dict, source: Source) -> str:
    """The keys of a row, and of the first turn of its conversation column, for error messages."""
    keys = ", ".join(sorted(map(str, row)))
    if source.format in ("messages", "sharegpt"):
        value = row.get(source.field("messages"))
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                return f"{keys}; {source.field('messages')!r} is a string that is not JSON"
        if isinstance(value, list) and value and isinstance(value[0], dict):
            keys += f"; turns have {{{', '.join(sorted(value[0]))}}}"
    return keys
