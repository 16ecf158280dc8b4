"""``eyrie accept``: its options, from ``AcceptConfig`` (``config.py``), over ``measure.run_accept``."""

from __future__ import annotations

from typing import Any

import typer

from pipeline.steps.accept.config import AcceptConfig
from pipeline.steps.options import OutDir, ReleaseTarget, TrustRemoteCode, settings_options, validated


@settings_options(AcceptConfig)
def accept(
    trust_remote_code: TrustRemoteCode = False,
    release_target: ReleaseTarget = "no",
    out_dir: OutDir = None,
    **settings: Any,
) -> None:
    """Accept length and output tokens/s of the draft, against the same decoder without it."""
    from pipeline.steps.accept.measure import run_accept
    from pipeline.steps.serving.sglang import release_url

    config = validated(AcceptConfig, **settings)
    granted = {"trust_remote_code": trust_remote_code, "release_target": release_url(release_target)}
    raise typer.Exit(run_accept(config.settings(**granted), out_dir))
