"""``eyrie prep``'s settings: its options, with these names (``cli.py`` derives them from here)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline.steps.options import Cli


class PrepConfig(BaseModel):
    """What ``run_prep`` runs with beside its catalog and output folder (its ``settings``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    offline: Annotated[bool, Cli(flags="--offline/--online")] = False
    """Read each source's local 'sample:' file (offline) or the hub and local files (online)."""
    quota: int | None = Field(0, ge=0, validate_default=True)
    """At most N records per source; 0: the catalog's own quotas."""
    seed: int | None = None
    """Shuffle seed (default: the catalog's)."""
    workers: int | None = None
    """At most this many sources at once (default: what memory allows)."""
    worker_memory: Annotated[str, Cli(metavar="SIZE")] = "512MiB"
    """Memory one source's worker may use; divides the budget into workers."""

    @field_validator("quota")
    @classmethod
    def _zero_is_the_catalogs(cls, value: int | None) -> int | None:
        return value or None
