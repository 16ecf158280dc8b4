"""``eyrie tokenize``'s settings: its options, with these names (``cli.py`` derives them from here)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from pipeline.steps.options import Cli
from pipeline.steps.records import MAX_LENGTH
from pipeline.steps.tokenize.chat_template import OWN_TEMPLATE, SHIPPED_TEMPLATES


class TokenizeConfig(BaseModel):
    """What ``run_tokenize`` runs with beside its inputs and output folder (its ``settings``; the
    permission ``trust_remote_code`` is the command's to grant)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    chat_template: str = Field(
        OWN_TEMPLATE,
        description=f"'{OWN_TEMPLATE}' (the folder's own: what Kimi-K2.5 should use), "
        f"{', '.join(map(repr, SHIPPED_TEMPLATES))} (Kimi-K2-style, NOT Kimi-K2.5's own template), "
        "or a .jinja file.",
    )
    max_length: int = Field(MAX_LENGTH, ge=1)
    """Truncate rows to this many tokens."""
    shard_rows: int = Field(8192, ge=1)
    """Rows per parquet shard."""
    workers: int | None = Field(None, ge=1)
    """Processes rendering and tokenizing (default: what memory allows, one per CPU)."""
    worker_memory: Annotated[str, Cli(metavar="SIZE")] = "256MiB"
    """Memory one worker may use; divides the budget into workers."""
