"""``eyrie tokenize``'s settings: its options, with these names (``cli.py`` derives them from here)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from pipeline.steps.options import Cli
from pipeline.steps.tokenize.chat_template import OWN_TEMPLATE, SHIPPED_TEMPLATES
from pipeline.steps.tokenize.run import DEFAULT_MAX_LENGTH, DEFAULT_SHARD_ROWS, DEFAULT_WORKER_MEMORY


class TokenizeConfig(BaseModel):
    """What ``run_tokenize`` runs with beside its inputs and output folder (its keyword arguments,
    but the permission ``trust_remote_code``, which the command grants)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    chat_template: str = Field(
        OWN_TEMPLATE,
        description=f"'{OWN_TEMPLATE}' (the folder's own: what Kimi-K2.5 should use), "
        f"{', '.join(map(repr, SHIPPED_TEMPLATES))} (Kimi-K2-style, NOT Kimi-K2.5's own template), "
        "or a .jinja file.",
    )
    max_length: int = Field(DEFAULT_MAX_LENGTH, ge=1)
    """Truncate rows to this many tokens."""
    shard_rows: int = Field(DEFAULT_SHARD_ROWS, ge=1)
    """Rows per parquet shard."""
    workers: int | None = Field(None, ge=1)
    """Processes rendering and tokenizing (default: what memory allows, one per CPU)."""
    worker_memory: Annotated[str, Cli(metavar="SIZE")] = DEFAULT_WORKER_MEMORY
    """Memory one worker may use; divides the budget into workers."""
