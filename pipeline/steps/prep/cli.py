"""``eyrie prep``: its options, over ``prep.prep``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.steps.options import OutDir
from pipeline.steps.prep.prep import DEFAULT_WORKER_MEMORY


def prep(
    catalog: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE|default",
            help="Catalog YAML of sources, or 'default' (the shipped ten-source mix, the default).",
        ),
    ] = None,
    offline: Annotated[
        bool,
        typer.Option(
            "--offline/--online",
            help="Read each source's local 'sample:' file (offline) or the hub and local files (online).",
        ),
    ] = False,
    quota: Annotated[
        int, typer.Option(min=0, help="At most N records per source; 0: the catalog's own quotas.")
    ] = 0,
    out_dir: OutDir = None,
    seed: Annotated[int | None, typer.Option(help="Shuffle seed (default: the catalog's).")] = None,
    workers: Annotated[
        int | None, typer.Option(help="At most this many sources at once (default: what memory allows).")
    ] = None,
    worker_memory: Annotated[
        str,
        typer.Option(
            metavar="SIZE", help="Memory one source's worker may use; divides the budget into workers."
        ),
    ] = DEFAULT_WORKER_MEMORY,
) -> None:
    """Sources -> prompts.jsonl, native.jsonl and native_tokenized.parquet, with per-source counts."""
    from pipeline.steps.prep.prep import prep as run_prep

    raise typer.Exit(
        run_prep(
            catalog, out_dir, offline=offline, seed=seed, quota=quota or None, workers=workers,
            worker_memory=worker_memory,
        )  # fmt: skip
    )
