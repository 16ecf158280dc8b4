"""The generation step's settings and their defaults: what ``eyrie generate``'s options show and
what the driver runs with (``cli.py`` reads each default here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.steps.generate.conversation import Mode
from pipeline.steps.retry import Retry


@dataclass
class Sampling:
    """What each request asks the server for (recorded with the rows: a rerun must ask the same)."""

    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = 2048
    seed: int | None = None

    @property
    def repeatable(self) -> bool:
        """Asked again, a server gives the same answer: greedy, or a seed per row."""
        return self.temperature == 0 or self.seed is not None


@dataclass
class GenerateConfig:
    prompts: Path
    out_dir: Path
    urls: list[str]
    model: str | None = None
    mode: Mode = "last_turn"
    concurrency: int = 32
    sampling: Sampling = field(default_factory=Sampling)
    chat_template_kwargs: dict[str, Any] | None = None
    drop_truncated: bool = False
    retry_errors: bool = False
    restart: bool = False
    request_timeout_s: float = 600.0
    health_timeout_s: float = 600.0
    """How long to wait for a server to answer ``/health``: at the start, and whenever it stops."""
    retry: Retry = field(default_factory=Retry)
    max_error_rate: float = 0.5
    error_window: int = 200
    api_key: str | None = None
    flush_rows: int = 512
    flush_interval_s: float = 1.0
    limit: int | None = None
