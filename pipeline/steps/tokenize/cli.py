"""``eyrie tokenize``: its options, from ``TokenizeConfig`` (``config.py``), over ``run.run_tokenize``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.steps.options import OutDir, TrustRemoteCode, settings_options, stop_when_checking, validated
from pipeline.steps.tokenize.config import TokenizeConfig


@settings_options(TokenizeConfig, checks_itself=True)
def tokenize(
    tokenizer: Annotated[
        str,
        typer.Option(metavar="FOLDER|HUB_ID", help="The target: a model folder or a hub id (its tokenizer)."),
    ],
    conversations: Annotated[
        list[Path] | None, typer.Option(help="A conversations .jsonl file (repeatable).")
    ] = None,
    tokenized: Annotated[
        list[Path] | None, typer.Option(help="A pre-tokenized .parquet file (repeatable).")
    ] = None,
    out_dir: OutDir = None,
    trust_remote_code: TrustRemoteCode = False,
    **settings: Any,
) -> None:
    """Conversations -> parquet shards of input_ids and an assistant-only loss_mask."""
    config = validated(TokenizeConfig, **settings)
    stop_when_checking()
    from pipeline.steps.tokenize.run import run_tokenize

    raise typer.Exit(
        run_tokenize(
            tokenizer,
            conversations or [],
            tokenized or [],
            out_dir,
            **config.model_dump(),
            trust_remote_code=trust_remote_code,
        )
    )
