"""``eyrie tokenize``: its options, over ``tokenize.tokenize``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.steps.options import TrustRemoteCode
from pipeline.steps.tokenize.tokenize import (
    DEFAULT_MAX_LENGTH,
    DEFAULT_SHARD_ROWS,
    DEFAULT_WORKER_MEMORY,
    OWN_TEMPLATE,
    SHIPPED_TEMPLATES,
)


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
    chat_template: Annotated[
        str,
        typer.Option(
            help=f"'{OWN_TEMPLATE}' (the folder's own: what Kimi-K2.5 should use), "
            f"{', '.join(map(repr, SHIPPED_TEMPLATES))} (Kimi-K2-style, NOT Kimi-K2.5's own template), "
            "or a .jinja file."
        ),
    ] = OWN_TEMPLATE,
    max_length: Annotated[int, typer.Option(help="Truncate rows to this many tokens.")] = DEFAULT_MAX_LENGTH,
    shard_rows: Annotated[int, typer.Option(help="Rows per parquet shard.")] = DEFAULT_SHARD_ROWS,
    out_dir: Annotated[
        Path | None, typer.Option(help="Where shards/ goes (default: the step dir, else the cwd).")
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            min=1, help="Processes rendering and tokenizing (default: what memory allows, one per CPU)."
        ),
    ] = None,
    worker_memory: Annotated[
        str, typer.Option(metavar="SIZE", help="Memory one worker may use; divides the budget into workers.")
    ] = DEFAULT_WORKER_MEMORY,
    trust_remote_code: TrustRemoteCode = False,
) -> None:
    """Conversations -> parquet shards of input_ids and an assistant-only loss_mask."""
    from pipeline.steps.tokenize.tokenize import tokenize as run_tokenize

    raise typer.Exit(
        run_tokenize(
            tokenizer, conversations or [], tokenized or [], out_dir, chat_template=chat_template,
            max_length=max_length, shard_rows=shard_rows, workers=workers, worker_memory=worker_memory,
            trust_remote_code=trust_remote_code,
        )  # fmt: skip
    )
