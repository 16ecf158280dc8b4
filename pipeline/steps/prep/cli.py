"""``eyrie prep``: its options, from ``PrepConfig`` (``config.py``), over ``run.run_prep``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.steps.options import OutDir, settings_options, stop_when_checking, validated
from pipeline.steps.prep.config import PrepConfig


@settings_options(PrepConfig, checks_itself=True)
def prep(
    catalog: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE|default",
            help="Catalog YAML of sources, or 'default' (the shipped ten-source mix, the default).",
        ),
    ] = None,
    out_dir: OutDir = None,
    **settings: Any,
) -> None:
    """Sources -> prompts.jsonl, native.jsonl and native_tokenized.parquet, with per-source counts."""
    config = validated(PrepConfig, **settings)
    stop_when_checking()
    from pipeline.steps.prep.run import run_prep

    raise typer.Exit(run_prep(catalog, out_dir, **config.model_dump()))
