"""The target's language model built on the meta device, held as its format says: what the planner
sizes (``train/placement.py``) and eyrie's loader fills (:func:`pipeline.steps.target.quantized.load_held`),
so that one build serves both."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pipeline.steps.target.format import TargetFormat
from pipeline.steps.target.holding import Holding


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings while it resolves a target's classes (e.g. "a model of type X to
    instantiate a model of type ''" for custom code) would bury the one line that matters."""
    from transformers.utils import logging

    previous = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(previous)


@dataclass
class MetaTarget:
    """The target's language model with its parameters on the meta device, held as it will be loaded."""

    model: Any
    format: TargetFormat
    left_out: int
    """Bytes of the wrapper's other modules (a vision tower and its projector): never loaded."""


def meta_target(fmt: TargetFormat, dtype: Any, *, trust_remote_code: bool) -> MetaTarget:
    """The causal language model of the target of format ``fmt`` on the meta device (buffers real),
    its quantized modules held as ``fmt`` holds them; a :class:`HeldFormatError` naming its dense size
    when ``fmt`` cannot be held where it was decided for.

    A wrapper's language model is its own remote code's ``language_model`` under
    ``--trust-remote-code``, else transformers' class for its ``text_config`` (for Kimi-K2.5:
    DeepSeek-V3); either way its names are the checkpoint's after ``fmt.prefix``.
    """
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModel, AutoModelForCausalLM

    from pipeline.steps.target.quantized import hold_packed

    config = fmt.config
    with init_empty_weights(include_buffers=False), quiet_transformers():
        if not fmt.wrapped:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
            left_out = 0
        else:
            loader = AutoModelForCausalLM if trust_remote_code else AutoModel
            wrapper = loader.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
            inner = getattr(wrapper, "language_model", None)
            ships_lm = trust_remote_code and inner is not None and inner.get_output_embeddings() is not None
            model = inner if ships_lm else AutoModelForCausalLM.from_config(fmt.text, dtype=dtype)
            left_out = sum(
                p.numel() * p.element_size()
                for name, p in wrapper.named_parameters()
                if "language_model" not in name and not name.startswith("lm_head")
            )
    model.tie_weights()  # the empty-weights context replaced the tied parameters with copies
    if fmt.refused is not None:
        raise fmt.refused.error(sum(p.numel() * p.element_size() for p in model.parameters()))
    if fmt.holding is Holding.PACKED:
        scale = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        hold_packed(model, fmt.quantization, fmt.prefix, scale_dtype=scale)
    return MetaTarget(model.requires_grad_(False), fmt, left_out)
