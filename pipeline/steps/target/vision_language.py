"""A target that comes as a vision-language wrapper (Kimi-K2.5 ships as
``KimiK25ForConditionalGeneration``): the steps read its language model only."""

from __future__ import annotations

from typing import Any


def language_config(config: Any) -> Any:
    """The language model's config: a vision-language wrapper's ``text_config`` (Kimi-K2.5 ships
    as ``KimiK25ForConditionalGeneration``), or the config itself."""
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config
