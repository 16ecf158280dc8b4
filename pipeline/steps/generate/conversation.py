"""What to ask the target for each prompt row, and how its answers become a conversation.

A prompt row (``prompts.jsonl``, as ``pipeline.steps.prep.sources.conversation_record`` writes
it) is ``{id, source, source_id, messages}`` with OpenAI chat messages. The output row
(``conversations.jsonl``) is SpecForge's
``{id, conversations: [{role, content, reasoning_content?, tool_calls?}]}`` plus the
row's ``source`` and the generation flags (``finish_reason``, ``truncated``, ``mode``).

- ``last_turn``: keep the source history, regenerate only the final assistant turn
  (or answer the final user/tool turn when the row has no answer yet).
- ``all_turns``: regenerate every assistant turn in order, each from a history of
  the regenerated answers. Rows with tool turns cannot be replayed that way (the
  tool results answer the *source* calls), so they fall back to ``last_turn``.
"""

from __future__ import annotations

from typing import Any, Literal

Mode = Literal["last_turn", "all_turns"]
MODES: tuple[Mode, ...] = ("last_turn", "all_turns")

# Keys of a chat message the OpenAI API accepts; anything else a source carried is dropped.
_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")


class PromptError(ValueError):
    """A prompt row that cannot be sent (no messages, unknown role): permanent, per row."""


def clean_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-format message: known keys only, tool calls and tool results kept as they are."""
    if not isinstance(message, dict) or message.get("role") not in (
        "system",
        "user",
        "assistant",
        "tool",
        "developer",
    ):
        raise PromptError(f"message with unknown role: {str(message)[:120]}")
    return {k: message[k] for k in _MESSAGE_KEYS if message.get(k) is not None}


def has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def answer_message(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant turn as the output keeps it: content, reasoning, tool calls."""
    turn: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    # SGLang's reasoning parser returns ``reasoning_content``; some servers say ``reasoning``.
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        turn["reasoning_content"] = reasoning
    if message.get("tool_calls"):
        turn["tool_calls"] = message["tool_calls"]
    return turn


class Plan:
    """The requests one row needs, in order: each ``next_history()`` is one chat request.

    ``feed(answer)`` gives the server's assistant message for the last request; when
    ``next_history()`` returns None the row is done and ``conversation`` holds it.
    """

    def __init__(self, messages: list[dict[str, Any]], mode: Mode) -> None:
        if not messages:
            raise PromptError("row has no messages")
        self.messages = [clean_message(m) for m in messages]
        self.fell_back = mode == "all_turns" and has_tool_turns(self.messages)
        self.mode: Mode = "last_turn" if self.fell_back else mode
        self.conversation: list[dict[str, Any]] = []
        self._cursor = 0
        if self.mode == "last_turn":
            history = self.messages
            if history[-1]["role"] == "assistant":
                history = history[:-1]
            if not history:
                raise PromptError("row has only an assistant turn, nothing to answer")
            self.conversation = list(history)
            self._cursor = len(self.messages)
        self._pending = False

    def next_history(self) -> list[dict[str, Any]] | None:
        if self._pending:
            raise RuntimeError("feed() the previous answer first")
        if self.mode == "last_turn":
            if self.conversation and self.conversation[-1]["role"] == "assistant":
                return None
            self._pending = True
            return self.conversation
        # all_turns: copy source turns up to the next assistant turn, then ask for it.
        while self._cursor < len(self.messages):
            message = self.messages[self._cursor]
            self._cursor += 1
            if message["role"] == "assistant":
                if self.conversation:
                    self._pending = True
                    return self.conversation
                continue  # an assistant turn with nothing before it cannot be regenerated
            self.conversation.append(message)
        if self.conversation and self.conversation[-1]["role"] != "assistant":
            self._pending = True
            return self.conversation
        return None

    def feed(self, answer: dict[str, Any]) -> None:
        self._pending = False
        self.conversation = [*self.conversation, answer_message(answer)]


def output_row(row: dict[str, Any], plan: Plan, finish_reasons: list[str | None]) -> dict[str, Any]:
    truncated = "length" in finish_reasons
    return {
        "id": row["id"],
        "source": row.get("source"),
        "source_id": row.get("source_id"),  # the dataset's own row id, kept through to the shards
        "conversations": [_for_output(m) for m in plan.conversation],
        "finish_reason": finish_reasons[-1] if finish_reasons else None,
        "truncated": truncated,
        "mode": plan.mode,
    }


def _for_output(message: dict[str, Any]) -> dict[str, Any]:
    # SpecForge reads ``content`` as a string; an assistant turn that only calls tools has none.
    if message.get("content") is None:
        return {**message, "content": ""}
    return message
