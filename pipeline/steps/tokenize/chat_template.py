"""The chat template a conversation is rendered with: the target's own, the shipped Kimi-K2-style
one, or a ``.jinja`` file; checked against the tokenizer's special tokens when loaded.

``render`` and ``render_all`` call the renderer behind ``apply_chat_template`` directly: it returns
the character spans between ``{% generation %}`` markers (``loss_mask.py`` takes the assistant's
output from them) and renders many conversations in one call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEMPLATES_DIR = Path(__file__).with_name("templates")
SHIPPED_TEMPLATES = {"kimi-k2": TEMPLATES_DIR / "kimi_k2.jinja"}
"""``kimi-k2`` is Kimi-K2-style with generation markers, not Kimi-K2.5's own template: a Kimi-K2.5
target uses its own (``--chat-template tokenizer``)."""
# The special tokens the Kimi-K2-style template writes: a tokenizer used with it must hold each as one token.
KIMI_K2_SPECIAL_TOKENS = [
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
]
OWN_TEMPLATE = "tokenizer"
"""``--chat-template`` for the template the tokenizer's folder ships (the default)."""
_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Special tokens a template writes literally; each must be ONE token of the tokenizer,
# or the rendered markup would be split into pieces the target never saw.
_MARKUP_RE = re.compile(r"<\|[A-Za-z0-9_]+\|>")


class TokenizeError(RuntimeError):
    """Tokenization cannot proceed; the message is one line saying what and how to fix it."""


@dataclass
class ChatTemplate:
    name: str
    source: str
    markers: bool
    names_calls_by_id: bool = False
    """It writes a tool call's id where other templates write the function's name (Kimi's do):
    conversations get Kimi's ids, ``functions.NAME:IDX``, before it renders them."""

    @property
    def method(self) -> str:
        """How the spans are found: ``generation_markers``, else ``message_probes`` (linear), which
        falls back to ``prefix_render`` for a conversation the template does not render message by
        message (the manifest counts those)."""
        return "generation_markers" if self.markers else "message_probes"


def load_template(choice: str, tokenizer: Any) -> ChatTemplate:
    """``tokenizer`` (the folder's own template), a shipped name (``kimi-k2``) or a ``.jinja`` path."""
    if choice == OWN_TEMPLATE:
        source = tokenizer.chat_template
        if isinstance(source, dict):
            source = source.get("default")
        if not source:
            raise TokenizeError(
                "the tokenizer folder has no chat template; pass --chat-template kimi-k2 or a .jinja file"
            )
        name = OWN_TEMPLATE
    else:
        path = SHIPPED_TEMPLATES.get(choice, Path(choice))
        if not path.is_file():
            raise TokenizeError(
                f"chat template {choice!r} is neither 'tokenizer', a shipped template "
                f"({', '.join(SHIPPED_TEMPLATES)}) nor an existing .jinja file"
            )
        source, name = path.read_text(encoding="utf-8"), choice
    vocab = tokenizer.get_vocab()
    missing = sorted({t for t in _MARKUP_RE.findall(source) if t not in vocab})
    if missing:
        raise TokenizeError(
            f"chat template {name!r} writes {', '.join(missing)}, which the tokenizer does not have as "
            f"tokens; use the target's own template (--chat-template tokenizer) or its tokenizer"
        )
    template = ChatTemplate(name, source, bool(_GENERATION_RE.search(source)))
    template.names_calls_by_id = _names_calls_by_id(template, dict(tokenizer.special_tokens_map))
    return template


def _names_calls_by_id(template: ChatTemplate, special: dict) -> bool:
    """Whether the template names a tool call only by its id: a probe call's id is in the text, its
    function's name is not."""
    call = {"id": "call_probe_id", "type": "function", "function": {"name": "probe_name", "arguments": "{}"}}
    probe = [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "!"},
    ]
    try:
        text, _ = render(template, probe, None, special=special)
    except Exception:  # a template that cannot render tool calls has no names to lose
        return False
    return call["id"] in text and call["function"]["name"] not in text


def render_all(
    template: ChatTemplate,
    conversations: list[list[dict]],
    tools: Any,
    generation_prompt: bool = False,
    special: dict | None = None,
) -> tuple[list[str], list[list[tuple[int, int]]]]:
    # The renderer behind apply_chat_template, called directly: it returns the {% generation %}
    # character spans, takes this conversation's own tools, and renders many in one call.
    from transformers.utils.chat_template_utils import render_jinja_template

    texts, indices = render_jinja_template(
        conversations=conversations,
        tools=tools,
        chat_template=template.source,
        return_assistant_tokens_mask=template.markers,
        add_generation_prompt=generation_prompt,
        **(special or {}),
    )
    return texts, [[tuple(span) for span in spans] for spans in indices] if template.markers else []


def render(
    template: ChatTemplate,
    messages: list[dict],
    tools: Any,
    generation_prompt: bool = False,
    special: dict | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    texts, indices = render_all(template, [messages], tools, generation_prompt, special)
    return texts[0], indices[0] if template.markers else []
