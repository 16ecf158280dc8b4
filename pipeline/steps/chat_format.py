"""Chat-format rules the steps share: what prep writes and tokenize renders must agree on them.

Tool calls carry Kimi's ids, ``functions.NAME:IDX``, which name the function.
"""

from __future__ import annotations

import re
from typing import Any

Message = dict[str, Any]

_KIMI_CALL_ID_RE = re.compile(r"functions\.(.+):\d+")


def kimi_tool_call_ids(messages: list[Message]) -> list[Message]:
    """The messages with Kimi's tool-call ids, ``functions.NAME:IDX`` (IDX counts the calls of the
    whole conversation from 0), and each tool result's ``tool_call_id`` remapped to match.

    Kimi's template writes a call's id where other templates write the function's name, so an
    OpenAI-style ``call_1`` would leave the name out of the tokens. Ids already all in Kimi's form
    (what the target itself generated) are kept as they are. A tool result whose id is missing or
    unknown answers the next unanswered call of the assistant turn before it.
    """
    calls = [c for m in messages if m.get("role") == "assistant" for c in m.get("tool_calls") or []]
    renumber = not all(_is_kimi_call_id(call) for call in calls)
    out: list[Message] = []
    renamed: dict[Any, str] = {}
    unanswered: list[str] = []
    index = 0
    for message in messages:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            renamed, unanswered, turn_calls = {}, [], []
            for call in message["tool_calls"]:
                new_id = f"functions.{_call_name(call)}:{index}" if renumber else call["id"]
                renamed.setdefault(call.get("id"), new_id)
                unanswered.append(new_id)
                turn_calls.append({**call, "id": new_id})
                index += 1
            message = {**message, "tool_calls": turn_calls}
        elif message.get("role") == "tool":
            call_id = message.get("tool_call_id")
            new_id = renamed.get(call_id)
            if new_id not in unanswered:
                new_id = unanswered[0] if unanswered else new_id or call_id
            if new_id in unanswered:
                unanswered.remove(new_id)
            if new_id is not None:
                message = {**message, "tool_call_id": new_id}
        out.append(message)
    return out


def _call_name(call: dict) -> Any:
    """A call's function name; templates accept both OpenAI's ``{function: {name}}`` and ``{name}``."""
    return (call.get("function") or call)["name"]


def _is_kimi_call_id(call: dict) -> bool:
    match = _KIMI_CALL_ID_RE.fullmatch(str(call.get("id") or ""))
    return match is not None and match.group(1) == _call_name(call)
