"""Tokenizing a conversation in pieces cut where the loss mask changes, without character offsets.

A fast tokenizer splits its input at its added tokens (``<|im_middle|>``,
``<|im_end|>``, ...) before it normalizes, pre-tokenizes or merges anything, and
tokenizes the text between them independently. So when every edge of every
assistant span touches such a token, the text cut at those edges tokenizes, piece
by piece, to exactly the tokens of the whole; every piece is wholly assistant
output or wholly not, and its mask is one value. Tracking character offsets is a
large share of a tokenization's cost, and pieces need none (``encode_batch_fast``).

Where an edge touches no added token (ChatML's ``<|im_start|>assistant\\n`` header
ends in a newline), the conversation keeps the whole-text path with offsets.
Tokenizers that treat a piece's start unlike a split of the whole (a ``Metaspace``
pre-tokenizer that prepends only to the first split) never take this path, nor do
added tokens that strip whitespace, match only whole words, or can overlap others.
"""

from __future__ import annotations

import json
import re
from typing import Any

Piece = tuple[int, int, int]
"""``(start, end, mask value)`` of one piece of a rendered conversation."""


class Pieces:
    """Cuts rendered conversations at their span edges where that tokenizes exactly as the whole."""

    def __init__(self, hf_tokenizer: Any):
        added = [token for token in hf_tokenizer.added_tokens_decoder.values() if token.content]
        self.contents = [token.content for token in added]
        self.splitting = {
            token.content
            for token in added
            if not (token.normalized or token.lstrip or token.rstrip or token.single_word)
        }
        self._isolated_known: dict[str, bool] = {}
        self.longest = max(map(len, self.splitting), default=0)
        # no splitting token: "(?!)" matches nowhere, so no edge is a cut point
        alternation = "|".join(map(re.escape, sorted(self.splitting, key=len, reverse=True))) or "(?!)"
        self.starting = re.compile(f"(?:{alternation})")
        self.ending = re.compile(rf"(?:{alternation})\Z")

    @classmethod
    def for_tokenizer(cls, hf_tokenizer: Any) -> Pieces | None:
        """``None`` when pieces of this tokenizer may tokenize differently from the whole text."""
        backend = hf_tokenizer.backend_tokenizer
        if not hasattr(backend, "encode_batch_fast"):
            return None
        if _first_split_only(json.loads(backend.to_str()).get("pre_tokenizer")):
            return None
        pieces = cls(hf_tokenizer)
        return pieces if pieces.splitting else None

    def cut(self, text: str, spans: list[tuple[int, int]]) -> list[Piece] | None:
        """The pieces of ``text`` (empty ones left out), or ``None`` where an edge touches no
        added token that splits there for certain."""
        edges: list[int] = []
        for start, end in spans:
            if start >= end:
                continue
            if edges and edges[-1] == start:  # adjacent spans are one
                edges[-1] = end
            else:
                edges += [start, end]
        for edge in edges:
            if 0 < edge < len(text) and not self._splits_at(text, edge):
                return None
        pieces, value, previous = [], 0, 0
        for edge in [*edges, len(text)]:
            if edge > previous:
                pieces.append((previous, edge, value))
            previous, value = edge, 1 - value
        return pieces

    def _splits_at(self, text: str, edge: int) -> bool:
        before = self.ending.search(text, max(0, edge - self.longest), edge)
        after = self.starting.match(text, edge)
        return any(m is not None and self._isolated(m.group()) for m in (before, after))

    def _isolated(self, token: str) -> bool:
        """No added token (itself included) can begin before ``token`` and run into it, and none
        contains it: wherever ``token`` appears, the tokenizer's leftmost-longest match picks it."""
        known = self._isolated_known.get(token)
        if known is None:
            prefixes = [token[:i] for i in range(1, len(token))]
            known = not any(
                (other != token and token in other) or any(map(other.endswith, prefixes))
                for other in self.contents
            )
            self._isolated_known[token] = known
        return known


def _first_split_only(component: Any) -> bool:
    """Whether a pre-tokenizer (or one inside a sequence) treats the text's first split specially."""
    if isinstance(component, dict):
        if component.get("type") == "Metaspace" and component.get("prepend_scheme") == "first":
            return True
        return any(_first_split_only(value) for value in component.values())
    if isinstance(component, list):
        return any(_first_split_only(value) for value in component)
    return False
